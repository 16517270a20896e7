"""The command line: LightningCLI over `ImageClassifier` and any LightningDataModule in `vit.data`."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import signal
import sys
import warnings
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

import vit.artifact as artifact
from vit.artifact.io import AtomicCheckpointIO
from vit.checks import CheckpointError, check_int, check_size, check_topk
from vit.data.base import DataNotFoundError
from vit.messages import first_line
from vit.models.pretrained import DEFAULT_SHAPE, PretrainedError, resolve_shape
from vit.registry import BACKBONES, signature
from vit.signatures import constructor_message
from vit.training import callbacks, preflight
from vit.training.classifier import ImageClassifier, format_test_results
from vit.training.cli_messages import ViTArgumentParser
from vit.training.dashboard import HParamsTable
from vit.training.predictions import PredictionWriter
from vit.training.preflight import ConfigError, as_config_error, is_local_file
from vit.training.run_dir import RunConfig, RunDirectoryError, check_run_dir

LINKED = ("num_classes", "in_chans", "img_size")  # the data module's, linked into the backbone's arguments


def _size(name: str, value: object) -> object:
    """`value` as compared: an image size as `(H, W)` (32 and [32, 32] are one size), anything else as it is."""
    if name == "img_size" and value is not None:
        with contextlib.suppress(ValueError, TypeError):
            return check_size(name, value)
    return value


class ViTCLI(LightningCLI):
    """LightningCLI that links the data's shape into the backbone, checks everything it can before a run starts,
    writes checkpoints atomically, resumes runs in their own folder and tests the best checkpoint after `fit`."""

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        self.parser_class = ViTArgumentParser  # the root parser's and each subcommand's
        # No prefixes of options: argparse would take `--trainer.max_ep 3` as `--trainer.max_epochs 3` without a word,
        # and a prefix that names another option after an upgrade would change a run silently.
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for name in LINKED:  # the data module knows them; the backbone must match
            parser.link_arguments(f"data.{name}", f"model.backbone.init_args.{name}", apply_on="instantiate")
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help=(
                "After `fit`, run `test` on the best checkpoint (by the ModelCheckpoint monitor) and print test/acc."
            ),
        )
        parser.add_argument(
            "--float32_matmul_precision",
            type=Literal["highest", "high", "medium"],
            default="high",
            help=(
                "torch.set_float32_matmul_precision, set before anything is built. 'high' lets "
                "float32 matmuls use TF32 tensor cores on NVIDIA GPUs (Ampere and newer); 'highest' "
                "keeps full float32; 'medium' allows bfloat16 internally (on CPUs too). "
                "Mixed-precision (bf16) matmuls are not affected."
            ),
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        torch.set_float32_matmul_precision(config.float32_matmul_precision)
        backbone_args = config.model.get("backbone", {}).get("init_args") or {}
        pretrained = config.model.get("pretrained")
        if (config.get("ckpt_path") is not None or self._model_folder is not None) and pretrained:
            # The checkpoint's weights replace the pretrained ones; loading these would cost time, or fail offline.
            config.model.pretrained = None
        elif pretrained and any(backbone_args.get(k, 0) is None for k in DEFAULT_SHAPE):
            # An unset backbone size is the source's, written into the config: checkpoints rebuild without the source.
            try:
                shape = resolve_shape(pretrained, **{name: backbone_args.get(name) for name in DEFAULT_SHAPE})
            except PretrainedError as err:
                raise ConfigError(f"model.{err}") from None
            for name, value in shape.items():
                backbone_args[name] = value

    def after_fit(self) -> None:
        # Runs in every process under DDP (test is a collective), prints on rank 0 only.
        if not self.config.fit.get("test_after_fit", True) or self.trainer.fast_dev_run:
            return
        best = self.trainer.checkpoint_callback.best_model_path if self.trainer.checkpoint_callback else ""
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best or None, verbose=False)
        self._print_test_report(results, best or "the final weights")
        if best and results and self.trainer.is_global_zero:
            record_test_metrics(artifact.folder_of(best), results[0])

    def test(self, **kwargs) -> None:
        """`train.py test`: Lightning's test, then the summary by class name (`format_test_results`)."""
        results = self.trainer.test(**kwargs)
        where = self._model_folder.source if self._model_folder is not None else kwargs.get("ckpt_path")
        self._print_test_report(results, where or "the configured weights")

    def _print_test_report(self, results: list[dict[str, float]], where: str) -> None:
        if self.trainer.is_global_zero and results:
            print(format_test_results(results[0], where) if "test/acc" in results[0] else f"test results: {results[0]}")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        parser.set_defaults({"test.verbose": False})  # `test` prints `format_test_results` instead of the table
        given = [str(a) for a in (sys.argv[1:] if args is None else args)] if not isinstance(args, dict) else []
        configs = [value for option, value in zip(given, given[1:]) if option == "--config"]
        ViTArgumentParser.configs = configs + [a.split("=", 1)[1] for a in given if a.startswith("--config=")]
        super().parse_arguments(parser, args)
        self._model_folder: artifact.Artifact | None = None  # validate/test/predict: the model it names
        self._resuming: str | None = None  # fit: the checkpoint the run continues from
        subcommand = self.config.get("subcommand")
        if subcommand is None:
            return
        config = self.config[subcommand]
        seed = config.get("seed_everything")
        if not isinstance(seed, bool) and seed is not None:  # `true` draws one
            as_config_error(check_int, "seed_everything", seed, 0, 2**32 - 1)  # numpy's range
        if is_local_file(config.get("ckpt_path")) and "://" not in str(config.ckpt_path):
            config.ckpt_path = os.path.expanduser(str(config.ckpt_path))
        preflight.resolve_resume(subcommand, config)
        preflight.resolve_hpc(subcommand, config)
        if subcommand != "fit" and config.get("ckpt_path"):
            # Evaluating a trained model needs no trainer state: it is built from its model folder (a .ckpt's, a
            # Hub id's, ...), and Lightning reads no checkpoint.
            self._model_folder = opened = artifact.load(config.ckpt_path)
            recorded = {"hyper_parameters": {"backbone": opened.backbone}}
            for line in preflight.check_given_config(subcommand, config, recorded, ImageClassifier, opened.source):
                rank_zero_warn(f"--ckpt_path {config.ckpt_path}: the model's value is used for {line}")
            config.ckpt_path = None
        elif is_local_file(config.get("ckpt_path")):
            # Resuming: the model and data are the run's own (its config.yaml); Lightning then restores the trainer
            # state through AtomicCheckpointIO, which loads it as data and confines its paths to the run.
            self._resuming = str(config.ckpt_path)
            recorded = preflight.run_record(config.ckpt_path)
            if recorded is not None:  # None: SLURM's requeue checkpoint, restored by the same command
                preflight.check_given_config(subcommand, config, recorded, ImageClassifier, config.ckpt_path)
                preflight.record_model(config, recorded)

    def _parse_ckpt_path(self) -> None:
        """No merge of the checkpoint's hyperparameters: its model is built from checked values."""

    def instantiate_classes(self) -> None:
        given = self._linked_given()
        # A constructor's error names a bad value: a usage error (see `main`), unlike the same error in training.
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as err:
            raise ConfigError(constructor_message(str(err))) from err
        for name, value in given.items():
            data = getattr(self.datamodule, name, None)  # what the link gave the backbone (a user's module: maybe none)
            if data is not None and _size(name, value) != _size(name, data):
                raise ConfigError(
                    f"model.backbone.init_args.{name}={value!r} differs from the data's {name}={data!r}, which the "
                    f"backbone takes (train.py links the data module's {name} into it): set --data.{name} instead"
                )
        if self._model_folder is not None:
            opened, backbone = self._model_folder, self._model_folder.backbone
            self.model = ImageClassifier(opened.model)
            self.model.class_names = list(opened.class_names)
            self._add_configure_optimizers_method_to_model(self.subcommand)
            preflight.check_data_fits(opened.source, backbone["init_args"], self.datamodule)
            preflight.record_backbone(self.config[self.subcommand], backbone)

    def _linked_given(self) -> dict:
        """The backbone's linked sizes (`add_arguments_to_parser`) set to other than its defaults: given by hand."""
        backbone = self.config[self.subcommand].model.get("backbone")
        class_path = backbone.get("class_path") if backbone is not None else None
        if class_path not in BACKBONES:
            return {}
        # The registry's reading of the constructor: a study's backbone passes its **kwargs to VisionTransformer's.
        defaults = {k: p.default for k, p in signature(BACKBONES[class_path])[0].items()}
        init_args = backbone.get("init_args") or {}
        return {
            name: init_args[name]
            for name in LINKED
            if init_args.get(name) is not None and _size(name, init_args[name]) != _size(name, defaults.get(name))
        }

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if not isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
            # Lightning reads checkpoints it finds itself (SLURM's requeue, `last` of an on-exception checkpoint):
            # another plugin would unpickle them without this project's checks.
            raise ConfigError(
                f"trainer.plugins: the checkpoint_io {type(trainer.strategy.checkpoint_io).__name__} "
                "would read checkpoints without this project's checks; train.py reads and writes them "
                "with vit.artifact.io.AtomicCheckpointIO (or a subclass)"
            )
        trainer.strategy.checkpoint_io.folders = lambda: {
            cb.state_key: Path(cb.dirpath).resolve() for cb in trainer.checkpoint_callbacks if cb.dirpath
        }
        # Lightning's default bar (Rich's where `rich` is installed, else tqdm's) redraws itself: in a log file, lines.
        if type(trainer.progress_bar_callback) in (TQDMProgressBar, RichProgressBar) and not sys.stdout.isatty():
            trainer.callbacks[trainer.callbacks.index(trainer.progress_bar_callback)] = callbacks.PlainProgress()
        if self.subcommand == "predict" and not any(isinstance(c, PredictionWriter) for c in trainer.callbacks):
            trainer.callbacks.append(PredictionWriter())  # `train.py predict` writes a CSV in the run folder
        if trainer.fast_dev_run:
            # A smoke test has no logger, so checkpoints would land in the current folder: none are kept.
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
        return trainer

    def _check_before_running(self) -> None:
        """The pre-flight: everything that can be checked before a run folder exists (a failure is exit 2)."""
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        for writer in [c for c in self.trainer.callbacks if isinstance(c, PredictionWriter)]:
            as_config_error(check_topk, writer.topk, len(self.model.class_names), option="PredictionWriter topk=")
        if self.subcommand == "fit" and self.datamodule is not None:
            try:
                preflight.forward_one_image(self.model, self.datamodule)
            except (ConfigError, CheckpointError, DataNotFoundError):
                raise
            except Exception as err:  # noqa: BLE001  (any other failure here is the config's)
                raise ConfigError(
                    f"pre-flight: one training image through the model failed: {type(err).__name__}: {first_line(err)}"
                ) from err
        for logger in self.trainer.loggers:
            if logger.save_dir:  # Lightning's `Logger.save_dir`: None for a logger without a folder
                preflight.check_writable(Path(logger.save_dir), "trainer.logger.init_args.save_dir")
        # RunConfig checks it too, but inside the run, where Lightning's clean-up would touch the other run.
        if self.save_config_callback and self.trainer.log_dir is not None:
            check_run_dir(Path(self.trainer.log_dir), stage=self.subcommand, ckpt_path=ckpt_path)

    before_validate = before_test = before_predict = _check_before_running

    def before_fit(self) -> None:
        for name, value in (("max_epochs", self.trainer.max_epochs), ("max_steps", self.trainer.max_steps)):
            if value == 0:
                raise ConfigError(
                    f"trainer.{name}=0 would train nothing: expected a positive number (or -1 for no limit)"
                )
        preflight.check_trainer_options(self.trainer)
        self._check_before_running()

    def fit(self, **kwargs) -> None:
        """`train.py fit`; a resume whose trainer state does not fit the run fails in one line (`CheckpointError`):
        what Lightning raises while restoring it, or in the first step (an optimizer state of other shapes)."""
        if self._resuming is None:
            return self.trainer.fit(**kwargs)
        started = callbacks.FirstStep()
        self.trainer.callbacks.append(started)
        try:
            self.trainer.fit(**kwargs)
        except (CheckpointError, ConfigError, RunDirectoryError, DataNotFoundError, callbacks.NonFiniteError):
            raise  # this project's own errors say what they are
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError, ArithmeticError) as err:
            if started.done:
                raise
            raise CheckpointError(
                f"checkpoint {self._resuming} cannot be resumed: {type(err).__name__}: {first_line(err)}"
            ) from err


def record_test_metrics(folder: Path, results: dict[str, float]) -> None:
    """Add the test metrics of a checkpoint to its model folder's record (`vit.training.test` in config.json), for
    its model card: replaced whole, as the folder was written."""
    if not artifact.is_artifact(folder):
        return
    config = artifact.read_config(folder)
    record = config["vit"].setdefault("training", {})
    record["test"] = {name: float(value) for name, value in results.items() if math.isfinite(value)}
    tmp = folder / f".{artifact.CONFIG}.{secrets.token_hex(8)}.tmp"
    tmp.write_text(json.dumps(config, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, folder / artifact.CONFIG)


def main(args=None) -> ViTCLI:
    """Entry point of `train.py`: `python train.py {fit,validate,test,predict} --config FILE`; an error a user can
    fix prints one `error: ...` paragraph, no traceback, and exits with 2 (usage) or 1."""
    # Silence torch's `LeafSpec` deprecation raised inside Lightning, and Lightning's advertisement for litlogger.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        if _no_litlogger_tip not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_no_litlogger_tip)
    # The command line that run_info.json records: `train.py` and its arguments.
    command = (
        list(sys.argv) if args is None else ["train.py", *map(str, args)] if isinstance(args, (list, tuple)) else None
    )
    try:
        always = [callbacks.RestoreRNGState(), callbacks.StopOnNonFinite(), callbacks.StopOnSignal(), HParamsTable()]
        return ViTCLI(
            ImageClassifier,
            L.LightningDataModule,
            subclass_mode_data=True,
            save_config_callback=RunConfig,
            save_config_kwargs={"overwrite": False, "command": command},
            trainer_defaults={"callbacks": always},
            # The optimizer and schedule are the model's (`--model.opt`, warmup + cosine over its parameter groups):
            # LightningCLI's own --optimizer / --lr_scheduler would drop those groups; they are refused by name.
            auto_configure_optimizers=False,
            args=args,
        )
    except (ConfigError, CheckpointError, RunDirectoryError) as err:
        _exit(f"error: {err}", code=2)
    except (callbacks.NonFiniteError, DataNotFoundError) as err:
        _exit(f"error: {err}", code=1)
    except callbacks.Preempted as err:
        _exit(str(err), code=128 + err.signum)
    except SIGTERMException:
        _exit(
            "stopped by SIGTERM during validation: last.ckpt holds the last finished training step. Resume with "
            "the same command and --ckpt_path last",
            code=128 + signal.SIGTERM,
        )
    finally:
        # Left to the interpreter's shutdown, a process group can abort a gloo process ("terminate called").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _no_litlogger_tip(record: logging.LogRecord) -> bool:
    return "pypi.org/project/litlogger" not in record.getMessage()


def script(args: list[str] | None = None) -> int:
    """Entry point of the `vit-train` command of an installed package: `main`, with an exit status (0) for the shell."""
    main(args)
    return 0


def _exit(message: str, code: int) -> None:
    print(message, file=sys.stderr)
    raise SystemExit(code)
