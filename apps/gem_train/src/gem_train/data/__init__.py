"""Data sources of the trainer: synthetic (planted teacher) and Parquet, and the batch format."""

from gem_train.data.batch import Batch
from gem_train.data.synthetic import SyntheticStream, Teacher

__all__ = ["Batch", "SyntheticStream", "Teacher"]
