"""The GEM-like model: embeddings, the jagged sequence tower, pooling, interaction and heads."""

from gem_train.model.gem import TASKS, GemModel, loss_of

__all__ = ["TASKS", "GemModel", "loss_of"]
