"""A W&B logger that runs offline by itself when it cannot run online (`--config configs/logger/wandb.yaml`)."""

from __future__ import annotations

import os
import socket
from typing import Any, Literal
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info

_LOCAL_MODES = ("offline", "dryrun", "disabled")  # the values of WANDB_MODE that keep a run on this machine


def wandb_online(probe_timeout: float = 3.0) -> tuple[bool, str]:
    """Whether a W&B run can go online now, `(online, reason)`: an explicit `WANDB_MODE` wins; else it needs stored
    credentials (without them the network is never touched) and the server accepting a TCP connection."""
    import wandb

    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in (*_LOCAL_MODES, "online"):
        return mode == "online", f"WANDB_MODE={mode}"
    # prompt=False only looks for stored credentials; verify=False keeps this off the network.
    if not wandb.login(prompt=False, verify=False):
        return False, "no W&B API key found (set WANDB_API_KEY or run `wandb login`)"
    base_url = os.environ.get("WANDB_BASE_URL") or wandb.setup().settings.base_url
    url = urlparse(base_url)
    try:
        socket.create_connection(
            (url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=probe_timeout
        ).close()
    except OSError as err:
        return False, f"the W&B server {base_url} cannot be reached ({err})"
    return True, f"credentials found and {base_url} reachable"


class WandbLogger(_LightningWandbLogger):
    """Lightning's `WandbLogger`, online when it can be and offline when not (`offline=None`: `wandb_online` decides);
    an offline run goes to `save_dir/wandb/offline-run-*` and prints the `wandb sync DIR` that uploads it.

    Args:
        save_dir: where W&B writes its `wandb/` folder; checkpoints and `config.yaml` go to `save_dir/project/run_id/`.
        entity, group, tags, notes, job_type: passed to `wandb.init`, as are any other keyword arguments.
        log_model: the checkpoints as W&B artifacts: True, those ModelCheckpoint keeps, when fit ends; "all", each
            as it is saved; False, none (offline too: `wandb sync` uploads them)."""

    def __init__(
        self,
        *,
        project: str = "vit",
        name: str | None = None,
        save_dir: str = "runs",
        offline: bool | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
        job_type: str | None = None,
        log_model: Literal["all"] | bool = False,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        # LightningCLI passes every wandb.init argument it knows of, mostly as None: drop those.
        kwargs = {
            key: value
            for key, value in dict(
                kwargs, entity=entity, group=group, tags=tags, notes=notes, job_type=job_type
            ).items()
            if value is not None
        }
        if "mode" in kwargs:  # an explicit wandb.init(mode=...) is obeyed as it is
            offline, self.mode_reason = kwargs["mode"] in _LOCAL_MODES, f"mode={kwargs['mode']!r} was asked for"
        elif offline is None:
            online, self.mode_reason = wandb_online()
            offline = not online
        else:
            self.mode_reason = f"offline={offline} was asked for"
        # To wandb.init directly: Lightning's `offline` would set WANDB_MODE for every later run of the process.
        kwargs.setdefault("mode", "offline" if offline else None)
        # Absolute: W&B's service process resolves a relative folder against its own working directory.
        super().__init__(
            name=name, save_dir=os.path.abspath(save_dir), project=project, log_model=log_model, prefix=prefix, **kwargs
        )
        self.is_offline = offline

    @property
    @rank_zero_experiment
    def experiment(self):
        """The `wandb` run; created on first use, printing where an offline run is written."""
        created, run = self._experiment is None, super().experiment
        if created and self.is_offline:
            run_dir = os.path.dirname(run.dir)  # run.dir is <run_dir>/files
            rank_zero_info(
                f"wandb: offline run ({self.mode_reason}), written to {run_dir}\n"
                f"wandb: upload it later with: wandb sync {run_dir}"
            )
        return run
