"""The MX codec: the integer element encoder against torch's own fp8 casts, the scale rule
against its definition in float64, decode and the format description."""

import pytest
import torch
from gem_lowprec import codec
from gem_lowprec.codec import E4M3, E5M2
from gem_lowprec.testing import all_finite_bf16

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
MODES = ["rceil", "floor"]


@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
def test_reference_elements_match_torch_cast(elem):
    """With scale 2^0 the reference's integer RNE is torch's own fp32 -> fp8 cast (after the
    saturation torch's cast does not do), on every bf16 pattern and on random float32."""
    fmt = E4M3 if elem == torch.float8_e4m3fn else E5M2
    gen = torch.Generator().manual_seed(2)
    rand32 = torch.randn(1 << 16, generator=gen) * torch.exp2(
        torch.randint(-40, 16, (1 << 16,), generator=gen).float()
    )
    for v in (all_finite_bf16().float(), rand32):
        v = v.clamp(-fmt.max_value, fmt.max_value)
        got = codec.encode(codec.fp32_bits(v), torch.full(v.shape, 127), fmt)
        assert torch.equal(got, v.to(elem).view(torch.uint8))


@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_scale_rule_against_definition(elem, mode):
    """The integer scale rule equals the definition evaluated exactly in float64."""
    fmt = E4M3 if elem == torch.float8_e4m3fn else E5M2
    amax = all_finite_bf16().float().abs().unique()
    got = codec.scale_bytes(codec.fp32_bits(amax), fmt, mode).to(torch.int64) - 127
    a = amax.double()
    if mode == "rceil":  # smallest e with amax / 2^e <= max_value
        e = torch.ceil(torch.log2(a / fmt.max_value))
        e = torch.where(a / torch.exp2(e - 1) <= fmt.max_value, e - 1, e)
        e = torch.where(a / torch.exp2(e) > fmt.max_value, e + 1, e)
    else:
        e = torch.floor(torch.log2(a)) - fmt.emax_exp
    e = torch.where(a == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    assert torch.equal(got, e.to(torch.int64))


def test_decode_is_exact_and_scale_bytes_are_powers_of_two():
    data = torch.tensor([1.5, -448.0, 0.0, 2.0**-9], dtype=torch.float8_e4m3fn)
    scale = torch.tensor([127, 0, 254, 0xFF], dtype=torch.uint8)
    out = codec.decode(data, scale)
    assert out[:3].tolist() == [1.5, -448.0 * 2.0**-127, 0.0] and out[3].isnan()
    assert codec.scale_to_float(torch.tensor([130], dtype=torch.uint8)).item() == 8.0


def test_format_description_is_one_object():
    assert E4M3.max_value == 448.0 and E5M2.max_value == 57344.0
    assert dict(E4M3.kernel_constants) == {
        "E4M3": True, "MBITS": 3, "EMIN": -6, "EMAX_EXP": 8, "MAX_BITS": 0x7E,
        "MAX_VALUE": 448.0, "NAN_BITS": 0x7F,
    }  # fmt: skip
    assert codec.elem_format(torch.float8_e5m2) is E5M2
    with pytest.raises(TypeError, match="elem_dtype"):
        codec.elem_format(torch.float16)


@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_range_limit_is_the_largest_element_that_stays_in_the_dtype(elem, dtype):
    """``range_max_bits`` is, for every scale byte a finite input of the dtype can get, the
    largest element whose value times the scale is below ``2^(range_emax + 1)`` (found by
    decoding every byte in float64)."""
    fmt = E4M3 if elem == torch.float8_e4m3fn else E5M2
    top = codec.range_emax(dtype)
    assert top == {torch.float16: 15}.get(dtype, 127)
    assert torch.finfo(dtype).max < 2.0 ** (top + 1) <= 2 * torch.finfo(dtype).max
    largest = torch.tensor([torch.finfo(dtype).max], dtype=dtype)
    last_byte = int(codec.scale_bytes(codec.fp32_bits(largest), fmt, "rceil"))
    assert last_byte == 127 + top - fmt.emax_exp + 1
    values = torch.arange(fmt.max_bits + 1, dtype=torch.uint8).view(elem).double()
    scale = torch.arange(last_byte + 1, dtype=torch.uint8)
    got = codec.range_max_bits(scale, fmt, top)
    fits = values[None, :] * torch.exp2(scale.double() - 127)[:, None] < 2.0 ** (top + 1)
    want = torch.where(fits, torch.arange(fmt.max_bits + 1), -1).amax(dim=1)
    assert torch.equal(got.to(torch.int64), want)
