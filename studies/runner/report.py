"""The study's reports, from its `runs.csv` (and `shortcuts.csv`) alone: tables and figures.

* ``summary.md`` / ``summary.csv``: per cell (experiment, task, model, training-set size) every run's
  test accuracy, the median, and the success count ``k/n`` with its 95% Clopper-Pearson interval,
  where success means beating the task's best shortcut (``shortcuts.csv``) by 5 points; with the
  learning rate, parameters, FLOPs per image and the median wall time of a run.
* ``calibration.md``: the learning-rate grid of each model family and the rate chosen.
* ``comparisons.md``: every pair of models within an experiment, seed-paired (exact permutation and
  sign tests on the accuracy differences) and by success counts (Fisher's exact test), each with
  Holm's correction over the pairs of its table (the family of tests a reader scans at once).
* ``<experiment>_<task>_runs.png``: a dot per run and the median per model.
* ``translation.md`` and ``<experiment>_<task>_shift.png`` (experiments with a ``shift_region``):
  each run's accuracy in its own region and on the moved test set, and the seed-paired tests.
* ``by_distance.md``: the same per distance bin, and for each CNN within and beyond its receptive field.
* ``<experiment>_<task>_by_distance.png``: test accuracy against the distance between the two parts, one
  curve per model (all seeds' test images pooled), each CNN's receptive field marked: the study's
  headline figure.
* ``visibility.md`` and ``<experiment>_<task>_visibility.png`` (``same_different``, from the per-image
  predictions in ``predictions/``): each CNN's accuracy on the pairs one of its units sees and on
  the others, and its curve against span beside the partial-view model's
  (``studies.runner.visibility``).

The tables are written by ``tables``, the figures by ``figures``, the visibility page and figure by
``visibility``. Every file it writes is named here; ``predictions.md`` (the predictions written before the runs)
is not one of them, and nothing in ``out_dir`` is deleted.
"""

from __future__ import annotations

from pathlib import Path

from studies.runner import figures, tables, visibility
from studies.runner.cells import per_cell, read_shortcuts


def write_reports(rows: list[dict], out_dir: Path, cfg: dict) -> None:
    """Every table and figure of the study from the rows of ``runs.csv`` (see the module doc)."""
    shortcuts = read_shortcuts(out_dir)
    cells = per_cell(rows)
    tables.summary(cells, shortcuts, out_dir, cfg)
    tables.calibration(rows, out_dir, cfg)
    tables.comparisons(cells, shortcuts, out_dir, cfg)
    tables.translation(cells, shortcuts, out_dir, cfg)
    tables.by_distance(cells, out_dir, cfg)
    figures.draw(cells, shortcuts, out_dir, cfg)
    visibility.report(cells, out_dir, cfg)
