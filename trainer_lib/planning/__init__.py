"""Planning a training step: which samples share a micro-batch, on which rank, in which slot.

Pure Python + numpy (no torch), in the order :func:`~trainer_lib.planning.plan.plan_step` calls
them (docs/PACKING.md §1, §3):

- :mod:`~trainer_lib.planning.plan` — a whole step: pad, cut into mini-batches, deal each;
  :class:`~trainer_lib.planning.plan.StepPlan` reports each rank's load.
- :mod:`~trainer_lib.planning.ahead` — :func:`~trainer_lib.planning.ahead.plan_ahead`: step
  ``t + 1`` planned on a background thread while the trainer runs step ``t``.
- :mod:`~trainer_lib.planning.padding` — zero-loss pads and the padded sample count.
- :mod:`~trainer_lib.planning.ranks` — one mini-batch as every rank's micro-batches.
- :mod:`~trainer_lib.planning.items` — one mini-batch's samples and rules
  (:class:`~trainer_lib.planning.items.MiniBatchItems`), built once, read by every step below.
- :mod:`~trainer_lib.planning.partition` — balanced data-parallel slots, with the bound of
  :mod:`~trainer_lib.planning.slot_bound` and the tighter packings of
  :mod:`~trainer_lib.planning.repack`; the search (on by default, within a time budget) of
  :mod:`~trainer_lib.planning.refine` (kernels: :mod:`~trainer_lib.planning.descent`,
  :mod:`~trainer_lib.planning.annealing`, on :mod:`~trainer_lib.planning.search`'s state).
- :mod:`~trainer_lib.planning.grouped` — the vision section balanced by compute, image groups
  kept together, after :mod:`~trainer_lib.planning.heavy_slot`'s slot of the samples that set
  their own pace.
- :mod:`~trainer_lib.planning.bins` — first-fit-decreasing and LPT bins of indices.
- :mod:`~trainer_lib.planning.cost` — FLOPs per sample, the predicted sync idle.
- :mod:`~trainer_lib.planning.packing` — samples checked, analysed and concatenated into
  :class:`~trainer_lib.micro_batch.PackedMicroBatch` es (``pack_samples``, one rank).

Every stage takes the family's :class:`~trainer_lib.spec.PackingSpec`. ``trainer_lib`` re-exports
the public names.
"""

__all__: list[str] = []  # the names live in the modules above (and in ``trainer_lib``)
