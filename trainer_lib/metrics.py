"""Prometheus counters of the trainer library (process-wide, default registry).

A trainer that exposes ``prometheus_client``'s registry (or pushes it) gets:
``mmref_trainer_images_materialized_total`` (images read and processed),
``mmref_trainer_image_slots_total`` (slots filled, duplicates included),
``mmref_trainer_placeholder_fallbacks_total`` (slots filled with zero features) and
``mmref_trainer_zeroed_samples_total``. The same numbers are in each
:class:`~trainer_lib.materialize.MaterializeStats`.
"""

from __future__ import annotations

from prometheus_client import Counter

__all__ = ["IMAGES_MATERIALIZED", "IMAGE_SLOTS", "PLACEHOLDER_FALLBACKS", "ZEROED_SAMPLES"]

IMAGES_MATERIALIZED = Counter("mmref_trainer_images_materialized", "Images read and processed.")
IMAGE_SLOTS = Counter("mmref_trainer_image_slots", "Image slots filled (duplicates included).")
PLACEHOLDER_FALLBACKS = Counter(
    "mmref_trainer_placeholder_fallbacks", "Image slots filled with zero features (missing image)."
)
ZEROED_SAMPLES = Counter("mmref_trainer_zeroed_samples", "Samples whose loss mask was zeroed.")
