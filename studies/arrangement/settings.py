"""What the arrangement audit scores: the images of each setting (`Images`), drawn as the study's runs draw them,
and which of them each table row pools (`Setting`, `span_subsets`, `study_settings`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from studies.runner.arrangement import DISC_SIZE, ArrangementDataModule, ArrangementDataset
from studies.runner.cells import distance_edges, model_rf
from studies.runner.grid import experiments, plan

FIT_SEED = 2001  # the data module's seed of the fresh draws the baselines are fit on (not a study seed)
PICK_SEED = 2003  # the coin that picks one disc per image for ``disc_random``
SPAN_OOD_BINS = ((21, 24), (25, 28), (29, 32))  # arrangement.md's span_ood table (report.span_ood_table)
LONG = 25  # the shortest span of the subset "spans >= 25"


@dataclass(frozen=True)
class Images:
    """What the audit reads of a set of arrangement images, one row per image."""

    labels: np.ndarray  # (N,) 0 clockwise, 1 counter-clockwise
    centres: np.ndarray  # (N, 2, 2) centre pixel of each disc (sample, disc, (row, col))
    span: np.ndarray  # (N,)
    pixels: np.ndarray  # (N, H * W) float32, the first channel
    blobs: np.ndarray  # (N,) 4-connected blobs above half the ink level
    pick: np.ndarray  # (N,) the disc that ``disc_random`` reads (0 or 1)

    @classmethod
    def of(cls, datasets: list[ArrangementDataset]) -> Images:
        """The images of ``datasets``, in order."""
        pixels = np.concatenate([ds.images[:, 0].numpy() for ds in datasets])  # (N, H, W)
        labels = np.concatenate([ds.labels.numpy() for ds in datasets])
        return cls(
            labels=labels,
            centres=np.concatenate([ds.positions.numpy() for ds in datasets]) + DISC_SIZE // 2,
            span=np.concatenate([ds.span.numpy() for ds in datasets]),
            pixels=pixels.reshape(len(pixels), -1),
            blobs=np.array([ndimage.label(im > 0.5)[1] for im in pixels]),
            pick=np.random.default_rng(PICK_SEED).integers(2, size=len(labels)),
        )

    def within(self, lo: int, hi: int) -> Images:
        """The images whose span is in ``[lo, hi]``."""
        keep = (self.span >= lo) & (self.span <= hi)
        return Images(**{k: getattr(self, k)[keep] for k in self.__dataclass_fields__})


@dataclass(frozen=True)
class Setting:
    """One split as the study draws it, the fresh draw of the same law that the baselines fit on, and the span
    subsets ``{(lo, hi): which tables score it}`` its tables score."""

    name: str
    scored: Images
    fit: Images
    subsets: dict[tuple[int, int], str]


def span_subsets(cfg: dict, experiment: str, lo: int, hi: int) -> dict[tuple[int, int], str]:
    """``{(lo, hi): which tables score it}``: the spans of the test images that the study's tables score for
    ``experiment`` (see the module doc), whose test spans run from ``lo`` to ``hi``."""
    subsets: dict[tuple[int, int], list[str]] = {}

    def add(a: int, b: int, why: str) -> None:
        subsets.setdefault((a, b), []).append(why)

    add(lo, hi, "every image")
    edges = distance_edges([lo, hi])
    for a, b in zip(edges[:-1], edges[1:]):
        add(int(a), int(b) - 1, "by_distance.md bin")
    exp = next(e for e in experiments(cfg) if e["name"] == experiment)
    for rf in sorted({rf for m in exp["models"] if (rf := model_rf(cfg, m)) is not None and lo <= rf < hi}):
        add(lo, rf, f"<= RF {rf} (by_distance.md)")
        add(rf + 1, hi, f"> RF {rf} (by_distance.md)")
    if experiment == "span_ood":
        for a, b in SPAN_OOD_BINS:
            add(a, b, "arrangement.md span_ood bin")
    if lo < LONG <= hi:
        add(LONG, hi, f"spans >= {LONG}")
    return {k: "; ".join(v) for k, v in subsets.items()}


def _split(
    init_args: dict, split: str, num_samples: int | None = None, region: str | None = None
) -> ArrangementDataset:
    """The ``split`` (``test`` or ``val``) of the data module a run makes from ``init_args``, as the run makes it;
    ``num_samples`` images (default: the run's), in ``region`` (default: the run's region of that split; the
    translation test scores the test split placed in its ``shift_region``)."""
    dm = ArrangementDataModule(**init_args)
    hp = dm.hparams
    region = region or (hp.test_region if split == "test" else hp.train_region)
    return dm.make_split(split, num_samples or hp[f"num_{split}"], region)


def study_settings(cfg: dict, num_fit: int) -> list[Setting]:
    """Every setting of the study's config ``cfg`` (see the module doc), with fresh draws of ``num_fit`` images."""
    data: dict[str, dict[int, dict]] = {}  # experiment -> seed -> the data module's init_args
    shift: dict[str, str] = {}  # experiment -> its shift_region
    lrs = {family: 1e-3 for family in cfg.get("families", {})} if "calibration" in cfg else None  # no effect on data
    for run in plan(cfg, lrs):
        if run.task == "arrangement":
            data.setdefault(run.experiment, {})[run.seed] = run.overrides["data"]["init_args"]
            if run.shift_region:
                shift[run.experiment] = run.shift_region
    settings = []
    for experiment, by_seed in data.items():
        first = next(iter(by_seed.values()))
        splits = [("test", None)] + [("val", None)] * (first.get("train_max_span") is not None)
        if experiment in shift:
            splits.append(("test", shift[experiment]))
        for split, region in splits:
            scored = Images.of([_split(args, split, region=region) for args in by_seed.values()])
            fit = Images.of([_split({**first, "seed": FIT_SEED}, split, num_fit, region)])
            lo, hi = int(scored.span.min()), int(scored.span.max())
            if region is not None:
                settings.append(Setting(f"{experiment}/shift", scored, fit, span_subsets(cfg, experiment, lo, hi)))
            elif split == "test":
                settings.append(Setting(experiment, scored, fit, span_subsets(cfg, experiment, lo, hi)))
            else:
                settings.append(Setting(f"{experiment}/val", scored, fit, {(lo, hi): "every image"}))
    return settings
