"""The command line: LightningCLI over `ImageClassifier` and any LightningDataModule in `vit.data`."""

from __future__ import annotations

import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from vit.checks import check_int
from vit.data.cifar import CIFARNotFoundError
from vit.training import ckpt_config
from vit.training.callbacks import (
    NonFiniteError,
    Preempted,
    RestoreRNGState,
    StopOnNonFinite,
    StopOnSignal,
    check_finite_weights,
)
from vit.training.checkpointing import (
    AtomicCheckpointIO,
    CheckpointError,
    check_checkpoint,
    find_last_checkpoint,
    read_checkpoint,
    remove_partial_writes,
)
from vit.training.classifier import ImageClassifier
from vit.training.run_dir import RunConfig, RunDirectoryError, check_run_dir


class ConfigError(ValueError):
    """A configuration value or command-line argument that cannot work, found before any work starts."""


class ViTCLI(LightningCLI):
    """LightningCLI that links the data's shape into the backbone and tests the best checkpoint after `fit`.

    It also makes runs robust: checkpoints are written atomically, `--ckpt_path last` continues the
    newest run of the configured logger in its own folder, a checkpoint is checked against the
    config before Lightning loads it, and bad values stop the run with a one-paragraph error.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data module knows the image size, channels and classes; the backbone must match them.
        for name in ("num_classes", "in_chans", "img_size"):
            parser.link_arguments(f"data.{name}", f"model.backbone.init_args.{name}", apply_on="instantiate")
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="After `fit`, run `test` on the best checkpoint (by the ModelCheckpoint monitor) and print test/acc.",
        )
        parser.add_argument(
            "--float32_matmul_precision",
            type=Literal["highest", "high", "medium"],
            default="high",
            help=(
                "torch.set_float32_matmul_precision, set before anything is built. 'high' lets float32 "
                "matmuls use TF32 tensor cores on NVIDIA GPUs (Ampere and newer); 'highest' keeps full "
                "float32; 'medium' allows bfloat16 internally (on CPUs too). Mixed-precision (bf16) "
                "matmuls are not affected."
            ),
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        torch.set_float32_matmul_precision(config.float32_matmul_precision)

    def after_fit(self) -> None:
        # Runs in every process under DDP (test is a collective), prints on rank 0 only.
        if not self.config.fit.get("test_after_fit", True) or self.trainer.fast_dev_run:
            return
        best = self.trainer.checkpoint_callback.best_model_path if self.trainer.checkpoint_callback else ""
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best or None, verbose=False)
        if self.trainer.is_global_zero and results:
            acc = results[0].get("test/acc")
            where = best or "the final weights"
            print(f"test/acc = {acc:.4f}  ({where})" if acc is not None else f"test results: {results[0]}")

    # --- Robust runs: resuming, checks before work starts, atomic checkpoints ----------------------

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # Before LightningCLI reads the checkpoint's hyperparameters into the config (it loads the
        # file right after parsing): resolve `last`, and fail with a message on an unreadable file.
        subcommand = self.config.get("subcommand")
        if subcommand is not None:
            config = self.config[subcommand]
            seed = config.get("seed_everything")
            if not isinstance(seed, bool) and seed is not None:
                try:
                    check_int("seed_everything", seed, 0, 2**32 - 1)  # numpy's range; `true` draws one
                except ValueError as err:
                    raise ConfigError(str(err)) from None
            _resolve_resume(subcommand, config)
            if _is_local_file(config.get("ckpt_path")):
                checkpoint = read_checkpoint(config.ckpt_path)
                for line in ckpt_config.check(subcommand, config, checkpoint, ImageClassifier, config.ckpt_path):
                    rank_zero_warn(f"--ckpt_path {config.ckpt_path}: the checkpoint's value is used for {line}")

    def instantiate_classes(self) -> None:
        # Constructors (ours and the Trainer's) check their arguments and raise ValueError or
        # MisconfigurationException naming the value: a usage error, not a bug, so it is reported as
        # one (see `main`). The same exceptions raised later, during training, are not caught.
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as err:
            raise ConfigError(_constructor_message(str(err))) from err

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # leave a user's own plugin alone
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if trainer.fast_dev_run:
            # A smoke test has no logger, so checkpoints would land in the current folder: none are kept.
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
        return trainer

    def before_fit(self) -> None:
        for name in ("max_epochs", "max_steps"):
            if getattr(self.trainer, name) == 0:
                raise ConfigError(f"trainer.{name}=0 would train nothing: expected a positive number (or -1 for no limit)")
        self._check_before_running()

    def before_validate(self) -> None:
        self._check_before_running()

    def before_test(self) -> None:
        self._check_before_running()

    def before_predict(self) -> None:
        self._check_before_running()

    def _check_before_running(self) -> None:
        """The pre-flight: everything that can be checked before a run folder exists.

        The checkpoint against the model, the loggers' save directories (test-written), the run
        folder, and for `fit` one forward pass of one training image and the optimizer's settings.
        Whatever fails here is a usage error (one line, exit 2), whatever its type.
        """
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        if _is_local_file(ckpt_path):
            checkpoint = check_checkpoint(ckpt_path, self.model, resume_training=self.subcommand == "fit")
            if "pytorch-lightning_version" not in checkpoint:
                raise CheckpointError(
                    f"checkpoint {ckpt_path} is not a checkpoint of this project: Lightning did not write it (no "
                    "'pytorch-lightning_version'). A plain state dict can be loaded in Python with "
                    "`model.load_state_dict(...)`"
                )
            check_finite_weights_of(checkpoint, ckpt_path)
            if self.subcommand == "fit":
                _check_same_world_size(checkpoint, ckpt_path, self.trainer.world_size)
        for logger in self.trainer.loggers:
            if getattr(logger, "save_dir", None):
                _check_writable(Path(logger.save_dir), "trainer.logger.init_args.save_dir")
        # RunConfig checks this too, but from inside the run, where Lightning's clean-up after the
        # error would already have added a TensorBoard file to the other run's folder.
        if self.save_config_callback and self.trainer.log_dir is not None:
            check_run_dir(Path(self.trainer.log_dir), stage=self.subcommand, ckpt_path=ckpt_path)
        if self.subcommand == "fit" and self.datamodule is not None:
            try:
                _forward_one_image(self.model, self.datamodule)
            except (ConfigError, CheckpointError, CIFARNotFoundError):
                raise
            except Exception as err:  # noqa: BLE001  (any other failure here is the config's)
                raise ConfigError(f"pre-flight: one training image through the model failed: "
                                  f"{type(err).__name__}: {_first_line(err)}") from err


def check_finite_weights_of(checkpoint: dict, ckpt_path) -> None:
    """A checkpoint whose weights hold NaN or infinity is refused by every subcommand."""
    try:
        check_finite_weights(checkpoint["state_dict"], int(checkpoint.get("global_step", 0)))
    except NonFiniteError as err:
        raise CheckpointError(f"checkpoint {ckpt_path} is unusable: {err}".replace(
            "; the checkpoint was not written, so the last one on disk is still a good one", "")) from err


def _check_same_world_size(checkpoint: dict, ckpt_path, world_size: int) -> None:
    """Resuming mid-epoch needs the number of processes the checkpoint was written with."""
    for state in checkpoint.values():
        if isinstance(state, dict) and "train_position" in state and "world_size" in state:
            if state["world_size"] != world_size:
                raise ConfigError(
                    f"checkpoint {ckpt_path} was written by {state['world_size']} process(es) and this run has "
                    f"{world_size}: each process's share of the epoch differs, so the run cannot continue where it "
                    f"stopped. Resume with {state['world_size']} process(es) (trainer.devices x trainer.num_nodes)"
                )


def _check_writable(folder: Path, option: str) -> None:
    """Raise `ConfigError` unless `folder` can be created and written; nothing is left behind.

    The deepest part of the path that exists must be a folder in which a file can be written.
    """
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option}={str(folder)!r} cannot be created: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(f"{option}={str(folder)!r} cannot be written: {existing}: {err.strerror or err}") from err


def _forward_one_image(model, datamodule) -> None:
    """One training image through the backbone (eager, eval mode, no gradient), so a shape or type error shows now."""
    if callable(getattr(datamodule, "missing_files", None)) and datamodule.missing_files():
        return  # prepare_data downloads them first, in the right process
    datamodule.setup("fit")
    dataset = getattr(datamodule, "train_set", None)
    if dataset is None or len(dataset) == 0:
        return
    x = dataset[0][0][None]  # (1, C, H, W)
    backbone = model.backbone
    was_training = backbone.training
    try:
        with torch.no_grad():
            backbone.eval()
            backbone.forward(x)  # .forward: not the compiled call, which would compile now
    finally:
        backbone.train(was_training)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _constructor_message(text: str) -> str:
    """The constructor's own message, out of jsonargparse's report for an optional class (`None | DataModule`).

    jsonargparse tries each type of the union and lists every failure, the constructor's ValueError
    among them; "Expected a <class 'NoneType'>" only says the value was not None.
    """
    if not text.startswith("Does not validate against any of the Union subtypes") or "\nErrors:\n" not in text:
        return text
    block = text.split("\nErrors:\n", 1)[1].split("\nGiven value type:", 1)[0]
    items = [" ".join(item.split()) for item in re.split(r"\n\s*- ", "\n" + block) if item.strip()]
    items = [item for item in items if not item.startswith("Expected a <class 'NoneType'>")]
    return "; ".join(items) or text


def _is_local_file(ckpt_path) -> bool:
    """False for None, for the names Lightning resolves itself ("best", "hpc", ...) and for URLs."""
    return ckpt_path is not None and ckpt_path not in ("best", "last", "hpc") and "://" not in str(ckpt_path)


def _resolve_resume(subcommand: str, config) -> None:
    """Turn `--ckpt_path last` into a file, and make `fit` from a checkpoint continue in that run's folder.

    A new run gets a new `version_N` folder, where Lightning's own "last" finds nothing. Here "last"
    is the newest `last.ckpt` under the logger's `save_dir/name/*/checkpoints/` (or under the
    version set in the config). When `fit` resumes from a checkpoint inside such a run folder and no
    version is set, and the checkpoint is that run's newest `last.ckpt`, the logger's version is set
    to that folder, so logs and checkpoints continue there; from an older checkpoint, training goes
    on in a new folder and the run is left as it is. Only loggers that lay runs out as
    `save_dir/name/version` (TensorBoard, CSV) are handled.
    """
    ckpt_path = config.get("ckpt_path")
    if ckpt_path is None:
        return
    logger = _logger_init_args(config)
    if logger is None:
        return
    root = Path(logger.save_dir) / (logger.get("name", "lightning_logs") or "")  # both loggers' default name
    version = logger.get("version")
    if ckpt_path == "last":
        runs = "*" if version is None else _version_dir(version)
        last = find_last_checkpoint(root, runs=runs)
        search = root / runs / "checkpoints"
        if last is None:
            if subcommand == "fit":
                rank_zero_warn(f"--ckpt_path last: no last.ckpt under {search}; starting a new run.")
                config.ckpt_path = None
                return
            raise ConfigError(f"--ckpt_path last: there is no last.ckpt under {search}")
        config.ckpt_path = ckpt_path = str(last)
    if subcommand != "fit" or version is not None or not _is_local_file(ckpt_path):
        return
    run_dir = Path(ckpt_path).resolve().parent.parent  # <run>/checkpoints/<file>
    if run_dir.parent != root.resolve():
        return
    newest = find_last_checkpoint(root, runs=run_dir.name)
    if newest is not None and newest.resolve() == Path(ckpt_path).resolve():
        logger.version = run_dir.name
        remove_partial_writes(Path(ckpt_path).parent)
        rank_zero_info(f"Resuming the run in {run_dir} from {ckpt_path}")
    else:  # continuing there would overwrite what the run saved after this checkpoint
        rank_zero_info(f"{ckpt_path} is not the newest last.ckpt of {run_dir}, which is left as it is; "
                       "training continues from it in a new run folder")


def _logger_init_args(config):
    """The `init_args` of a single TensorBoardLogger / CSVLogger in the trainer config, else None."""
    logger = config.get("trainer", {}).get("logger")
    class_path = str(getattr(logger, "class_path", "") or "")
    if not class_path.endswith(("TensorBoardLogger", "CSVLogger")) or getattr(logger, "init_args", None) is None:
        return None
    return logger.init_args


def _version_dir(version) -> str:
    return version if isinstance(version, str) else f"version_{version}"


def main(args=None) -> ViTCLI:
    """Entry point of `train.py`: `python train.py {fit,validate,test,predict} --config FILE`.

    Errors a user can fix (missing data, a bad config value, an unusable checkpoint or run
    folder, a loss that diverged) are printed as one `error: ...` paragraph without a traceback,
    and the process exits with status 2 (usage) or 1 (`SystemExit` when called in-process).
    """
    try:
        return ViTCLI(
            ImageClassifier,
            L.LightningDataModule,
            subclass_mode_data=True,
            save_config_callback=RunConfig,
            save_config_kwargs={"overwrite": False, "command": _command(args)},
            # Always present, not configurable: exact resumes and a loud stop on a diverged loss.
            trainer_defaults={"callbacks": [RestoreRNGState(), StopOnNonFinite(), StopOnSignal()]},
            args=args,
        )
    # Errors a user can fix are one paragraph, not a traceback.
    except (ConfigError, CheckpointError, RunDirectoryError) as err:
        _exit(f"error: {err}", code=2)
    except (NonFiniteError, CIFARNotFoundError) as err:
        _exit(f"error: {err}", code=1)
    except Preempted as err:
        _exit(str(err), code=128 + err.signum)
    except SIGTERMException:
        _exit("stopped by SIGTERM during validation: last.ckpt holds the last finished training step. Resume with "
              "the same command and --ckpt_path last", code=128 + signal.SIGTERM)
    finally:
        # Each DDP process leaves its process group before the interpreter exits; a group left to
        # the interpreter's shutdown aborted a gloo process at times ("terminate called").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _command(args) -> list[str] | None:
    """The command line to record in run_info.json: `train.py` and its arguments."""
    if args is None:
        return list(sys.argv)
    return ["train.py", *map(str, args)] if isinstance(args, (list, tuple)) else None


def _exit(message: str, code: int) -> None:
    print(message, file=sys.stderr)
    raise SystemExit(code)
