"""Fuzz the doors that open a checkpoint, a weight file or an image for longer than the test suite does, and
summarise what each did.

    python benchmarks/fuzz_checkpoints.py --examples 2000 [--doors reader,fit] [--seed 0]
    python benchmarks/fuzz_checkpoints.py --examples 500 --doors create_vit,load_pretrained,decode,predict,hpc

The same strategy as `tests/test_checkpoint_fuzz.py` (`tests/checkpoint_mutations.py`): one tiny run is
trained, then each example changes one key path of its `last.ckpt` (a value of another type, a huge
number, a class path, a `..` path, a URL, a tensor of another shape or layout, a deep nesting, a key
deleted or added), saves it as the run's `last.ckpt`, and opens it through one door: the reader behind
Lightning (`AtomicCheckpointIO.load_checkpoint`, bound to the run as `train.py` binds it) or `train.py fit
--ckpt_path` (one epoch more, in the run's own folder; the trainer state is drawn twice as often), each in this
process. (The inference doors open the model folder beside a checkpoint, never the checkpoint: the `artifact` door
fuzzes that.) Before the random examples, the mutations an attacker would try first are tried
(`notable_mutations`). `--examples` is the number of random examples per door.

Printed per door: the variants tried, accepted, refused (grouped by the first words of the error,
values elided) and failed: any other exception, a traceback, an exit code other than 0 or 2, a
marker file created by code the checkpoint named, or a file beside the run folder touched. Each
failure is printed with its key path, value and the end of its traceback (`--log FILE` keeps every
variant and its outcome, one JSON line each). The exit status is 1 when any variant failed.

The input doors use `tests/input_mutations.py` (as `tests/test_input_fuzz.py` does): `create_vit` and
`load_pretrained` open a weight file made from a tiny timm ViT and mutated (dtypes, values, shapes, names, the
safetensors header, the zip archive, bytes, a FIFO in its place, its config.json); `decode` (`decode_image`) and
`predict` (`vit.load` of the reference checkpoint, then `.predict(path)`) open an image Pillow wrote and that was
mutated (formats, modes, values, sizes, bytes). Each variant has a deadline and a memory bound; its group in the
summary is the last change made. `artifact` opens a tiny ViT's model folder with one `config.json` value, key or
file changed (`tests/artifact_mutations.py`) through `vit.load` and one forward pass. `hpc` plants a hostile
`hpc_ckpt_1.ckpt` once and gives it to the reader behind Lightning and to `train.py fit --ckpt_path hpc` (no random
variants).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the mutation helpers live beside the test that uses them

from checkpoint_mutations import (
    Mutation,
    Outcome,
    Site,
    Trained,
    mutations,
    notable_mutations,
    open_with_cli,
    open_with_reader,
    section,
    train_checkpoint,
)
from hypothesis import HealthCheck, Phase, given, seed, settings

from vit.commands import EitherSpelling

CHECKPOINT_DOORS = ("reader", "fit")
WEIGHT_DOORS = ("create_vit", "load_pretrained")
IMAGE_DOORS = ("decode", "predict")
DOORS = (*CHECKPOINT_DOORS, *WEIGHT_DOORS, *IMAGE_DOORS, "artifact", "hpc")


@dataclass
class DoorReport:
    """What one door did with every variant it was given."""

    door: str
    seconds: float = 0.0
    reason: Callable[[str], str] = field(default=lambda message: reason(message), repr=False)
    outcomes: list[tuple[Mutation, Outcome]] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(outcome.status == status for _, outcome in self.outcomes)

    def reasons(self) -> Counter:
        return Counter(self.reason(outcome.detail) for _, outcome in self.outcomes if outcome.status == "refused")

    def sections(self) -> dict[str, Counter]:
        found: dict[str, Counter] = {}
        for mutation, outcome in self.outcomes:
            found.setdefault(group(mutation), Counter())[outcome.status] += 1
        return found


def group(item) -> str:
    """Where a variant belongs in the summary: a checkpoint's section, an input variant's last change, a door."""
    if isinstance(item, Mutation):
        return section(item.path)
    return getattr(item, "group", str(item))


def reason(message: str, words: int = 5) -> str:
    """The first `words` words of a refusal, without the file's name, values, numbers and key paths past their
    third part: refusals for one cause in one part of the checkpoint group together."""
    text = message.removeprefix("error: ")
    text = re.sub(r"^checkpoint \S+?(:| cannot be resumed:)? ", "", text)
    text = re.sub(r"ModelCheckpoint\{.*?\}", "ModelCheckpoint{…}", text)
    text = re.sub(r"=.*(?= is not allowed)|=.*?(?= disagrees| and inputs\.|: |$)", "=…", text, count=1)
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\d+", "N", text)
    head, _, rest = text.partition(" ")
    key, equals, value = head.partition("=")
    parts = re.split(r"(?=[.\[])", key)  # `a.b[N].c` -> `a`, `.b`, `[N]`, `.c`
    if len(parts) > 3:
        key = "".join(parts[:3]) + "…"
    return " ".join(f"{key}{equals}{value} {rest}".split()[:words])


def input_reason(message: str, words: int = 7) -> str:
    """The first `words` words of a weight file's or an image's refusal, its file's name and values elided."""
    text = re.sub(r"^pretrained='[^']*':? ", "", message)
    text = re.sub(r"^/.*?: (?=\S)", "", text, count=1)  # an image's `path: reason`
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"/\S+", "<path>", text)
    return " ".join(re.sub(r"\d+", "N", text).split()[:words])


def fuzz(door: str, trained: Trained, root: Path, examples: int, random_seed: int, log: Path | None) -> DoorReport:
    """Open `examples` random variants (after the notable ones) through `door`; return what it did with each
    (and append it to the JSON-lines file `log`)."""
    site = Site.make(root / door)
    base = trained.moved_to(site)
    report = DoorReport(door)

    def one(mutation: Mutation) -> None:
        site.reset(trained)
        site.write(mutation.apply(base))
        outcome = open_with_reader(site, trained) if door == "reader" else open_with_cli(door, site)
        report.outcomes.append((mutation, outcome))
        if log is not None:
            with open(log, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "door": door,
                            "mutation": repr(mutation),
                            "section": section(mutation.path),
                            "status": outcome.status,
                            "detail": outcome.detail,
                        }
                    )
                    + "\n"
                )
        if outcome.status == "failed":
            print(f"  {door}: FAILED {mutation!r}: {outcome.detail}", flush=True)

    # No shrinking: every variant is recorded and the run goes on, instead of stopping at the first failure.
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed(random_seed)
    @given(mutations(base, site, weigh_trainer_state=door == "fit"))
    def random_examples(mutation: Mutation) -> None:
        one(mutation)

    start = time.perf_counter()
    for mutation in notable_mutations(base, site):
        one(mutation)
    if examples:
        random_examples()
    report.seconds = time.perf_counter() - start
    return report


def summary(reports: list[DoorReport], top: int) -> str:
    lines = [f"{'door':<16}{'tried':>7}{'accepted':>10}{'refused':>9}{'failed':>8}{'seconds':>10}"]
    lines += [
        f"{r.door:<16}{len(r.outcomes):>7}{r.count('accepted'):>10}{r.count('refused'):>9}"
        f"{r.count('failed'):>8}{r.seconds:>10.1f}"
        for r in reports
    ]
    for r in reports:
        lines += ["", f"{r.door}: tried / accepted / refused / failed by section or group"]
        lines += [
            f"  {name:<34}{sum(c.values()):>5}{c['accepted']:>5}{c['refused']:>5}{c['failed']:>5}"
            for name, c in sorted(r.sections().items())
        ]
        reasons = r.reasons()
        lines += ["", f"{r.door}: refused, by the first words of the error ({len(reasons)} groups)"]
        lines += [f"  {n:>5}  {text}" for text, n in reasons.most_common(top)]
        if len(reasons) > top:
            lines.append(
                f"  {sum(n for _, n in reasons.most_common()[top:]):>5}  ... in {len(reasons) - top} smaller groups"
            )
        failed = [(m, o) for m, o in r.outcomes if o.status == "failed"]
        lines += ["", f"{r.door}: failed ({len(failed)})"]
        lines += [f"  {m!r}\n    {o.detail}" for m, o in failed]
    return "\n".join(lines)


def _input_door(door: str, root: Path, predictor) -> tuple[Callable, list, object]:
    """`(opener, notable variants, strategy of random variants)` of a weight-file, an image or the artifact door."""
    from input_mutations import (
        decode_door,
        image_variants,
        notable_image_variants,
        notable_weight_variants,
        predict_door,
        reference_weights,
        weight_variants,
        weights_door,
    )

    if door == "artifact":
        from artifact_mutations import artifact_door, folder_variants, notable_folder_variants, reference_folder

        opener, notable = artifact_door, notable_folder_variants()
        strategy = folder_variants(reference_folder(root))
    elif door in WEIGHT_DOORS:
        reference = reference_weights()
        opener, notable, strategy = weights_door(door), notable_weight_variants(reference), weight_variants(reference)
    else:
        opener = decode_door if door == "decode" else predict_door(predictor)
        notable, strategy = [variant for variant, _ in notable_image_variants()], image_variants()
    return opener, notable, strategy


def fuzz_inputs(door: str, root: Path, examples: int, random_seed: int, log: Path | None, predictor) -> DoorReport:
    """As `fuzz`, for a weight-file or an image door (`tests/input_mutations.py`)."""
    from input_mutations import opened

    report, folder = DoorReport(door, reason=input_reason), root / door
    opener, notable, strategy = _input_door(door, root, predictor)

    def one(variant) -> None:
        outcome = opened(opener, variant, folder)
        report.outcomes.append((variant, outcome))
        if log is not None:
            with open(log, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "door": door,
                            "variant": repr(variant),
                            "group": variant.group,
                            "status": outcome.status,
                            "detail": outcome.detail,
                        }
                    )
                    + "\n"
                )
        if outcome.status == "failed":
            print(f"  {door}: FAILED {variant!r}: {outcome.detail}", flush=True)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed(random_seed)
    @given(strategy)
    def random_examples(variant) -> None:
        one(variant)

    start = time.perf_counter()
    for variant in notable:
        one(variant)
    if examples:
        random_examples()
    report.seconds = time.perf_counter() - start
    return report


def fuzz_hpc(trained: Trained, root: Path) -> DoorReport:
    """The planted `hpc_ckpt_1.ckpt` through the reader behind Lightning and `train.py fit --ckpt_path hpc`."""
    from test_checkpoint_fuzz import open_hpc, plant_hpc

    report, start = DoorReport("hpc"), time.perf_counter()
    for door in ("reader", "fit"):
        site = Site.make(root / "hpc" / door)
        plant_hpc(trained, site)
        outcome = open_hpc(door, site)
        report.outcomes.append((f"hpc_ckpt_1.ckpt through {door}", outcome))
        if outcome.status == "failed":
            print(f"  hpc: FAILED through {door}: {outcome.detail}", flush=True)
    report.seconds = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> int:
    parser = EitherSpelling(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="random variants per door (default 200)")
    parser.add_argument("--doors", default="reader", help=f"comma-separated, of {','.join(DOORS)} (default reader)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis's seed: the same seed tries the same variants")
    parser.add_argument("--top", type=int, default=30, help="refusal groups printed per door (default 30)")
    parser.add_argument(
        "--log", type=Path, default=None, help="a JSON-lines file to append every variant and what its door did to"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="a folder to work in and keep (default: a temporary folder, removed at the end)",
    )
    args = parser.parse_args(argv)
    doors = [d.strip() for d in args.doors.split(",") if d.strip()]
    unknown = [d for d in doors if d not in DOORS]
    if unknown:
        parser.error(f"--doors: {unknown} not among {list(DOORS)}")
    with tempfile.TemporaryDirectory(prefix="fuzz_checkpoints_") as tmp:
        root = args.keep or Path(tmp)
        start = time.perf_counter()
        trained = train_checkpoint(root / "reference")
        print(f"trained the reference checkpoint in {time.perf_counter() - start:.1f} s", flush=True)
        reports, predictor = [], None
        if "predict" in doors:
            import vit

            predictor = vit.load(trained.run_dir / "checkpoints" / "last.ckpt")
        for door in doors:
            if door in CHECKPOINT_DOORS:
                reports.append(fuzz(door, trained, root, args.examples, args.seed, args.log))
            elif door == "hpc":
                reports.append(fuzz_hpc(trained, root))
            else:
                reports.append(fuzz_inputs(door, root, args.examples, args.seed, args.log, predictor))
            print(f"{door}: {len(reports[-1].outcomes)} variants in {reports[-1].seconds:.1f} s", flush=True)
    print()
    print(summary(reports, args.top))
    return 1 if any(r.count("failed") for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
