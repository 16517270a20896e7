"""The arrangement study, one command: the shortcut audit, the grid, attention blocking and every report.

    python -m studies.arrangement                  # the matched grid, resumable (~60 min on 2 cores)
    python -m studies.arrangement --report-only    # every table and figure again, from the results
    python -m studies.arrangement --config studies/arrangement/configs/arrangement.yaml --report-only  # the first grid

In order: the audit of the config's own images (``shortcuts``, into ``<out_dir>/audit``) if it is not there yet;
the audit in the runner's format (``report.runner_shortcuts``), which the runner's report counts successes
against; the grid of the config (default ``configs/matched.yaml``) through the shared runner (``studies.runner``:
its calibration, its runs and its reports); attention blocking on the ViT checkpoints the runs left
(``report.run_blocking``); then ``arrangement.md`` (``report.write``). ``--report-only`` runs nothing: it rewrites
the runner's reports and ``arrangement.md`` from the committed results. The runner's other options (``--list``,
``--max-runs``, ``--executor``, ...) pass through; its errors and exit statuses are the runner's.
"""

from __future__ import annotations

from pathlib import Path

from studies.arrangement import report, shortcuts
from studies.runner.__main__ import exit_codes, parse_args, read_config, run
from studies.runner.lock import make_dirs
from studies.runner.runs_csv import read_rows

PROG = "python -m studies.arrangement"
CONFIG = "studies/arrangement/configs/matched.yaml"  # the first grid: configs/arrangement.yaml


def main(argv: list[str] | None = None) -> None:
    """`python -m studies.arrangement` (see the module doc)."""
    args = parse_args(argv, prog=PROG, description=__doc__.split("\n\n")[0], config=CONFIG)
    cfg = read_config(args.config)
    results = Path(cfg["out_dir"])
    with exit_codes(results / "runs.csv"):
        if args.list:
            run(args, cfg, prog=PROG)
            return
        audit = report.audit_path(results)
        if not args.report_only and not audit.exists():
            shortcuts.main(["--out", str(audit.parent), "--config", args.config])
        make_dirs("out_dir", results)
        report.runner_shortcuts(results)
        run(args, cfg, prog=PROG)
        rows = read_rows(results / "runs.csv")
        if not args.report_only:
            report.run_blocking(rows, results, Path(cfg["log_dir"]))
        report.write(rows, results)


if __name__ == "__main__":
    main()
