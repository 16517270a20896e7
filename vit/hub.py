"""The Hugging Face Hub, in one place: ids (`is_hub_id`), a repo's files through `huggingface_hub`'s cache
(`hub_folder`: its cache first; offline or where the Hub cannot be reached, `vit.offline`, only the cache), a timm
name's repo (`timm_repo`), and the Hub id a run started from (`hub_base_model`, `hub_dataset`: a model card names
only these)."""

from __future__ import annotations

import re
from pathlib import Path

from vit.checks import CheckpointError
from vit.messages import first_line
from vit.offline import cache_only_if_unreachable


class HubError(CheckpointError):
    """A Hub id that cannot be had here; one line saying what to do."""


_TIMM_NAME = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)?")  # timm's model names, with a pretrained tag: no path


def timm_repo(name: str) -> str | None:
    """The Hub repo of a timm model name's pretrained weights (`vit_tiny_patch16_224`, or with its tag; timm keeps
    its weights in the Hub's cache); None for anything else."""
    from timm.models import get_pretrained_cfg

    if not _TIMM_NAME.fullmatch(name):
        return None
    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError:  # a tag timm does not have
        cfg = None
    if cfg is None or not cfg.hf_hub_id:
        return None
    return cfg.hf_hub_id


def hub_folder(repo: str, files: tuple[str, ...]) -> Path:
    """The local folder holding `files` of a Hub repo (`org/name[@revision]`), downloaded only where allowed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo_id, _, revision = repo.partition("@")
    try:
        with cache_only_if_unreachable():
            return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(files)))
    except HFValidationError as err:
        raise HubError(f"hf-hub:{repo} is not a Hub id (org/name[@revision]): {first_line(err)}") from None
    except LocalEntryNotFoundError:
        raise HubError(
            f"hf-hub:{repo} is not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1): download it where the network allows "
            f"(`hf download {repo_id}`), or give its folder"
        ) from None
    except OSError as err:  # the Hub's own errors (no such repo, gated, HTTP) are OSErrors
        raise HubError(f"hf-hub:{repo} cannot be fetched: {first_line(err)[:300]}") from None


def hub_base_model(pretrained: object) -> str | None:
    """The Hub id of the weights `ImageClassifier(pretrained=...)` started from: a hub id without `hf-hub:` and
    `@revision`, a timm name as its repo (`timm/<name>.<tag>`); None for a local file, a name timm does not know, or
    anything that is not one line a Hub id could be (`is_hub_id`): the model card's front matter carries no other."""
    from timm.models import get_pretrained_cfg

    from vit.models.weights import source_kind

    if not isinstance(pretrained, str) or not 0 < len(pretrained) <= 256 or not pretrained.isprintable():
        return None
    try:
        kind = source_kind(pretrained)
    except OSError:  # a name the file system cannot look up (one part longer than it allows): no Hub id either
        return None
    if kind == "hub":
        base = re.sub(r"^hf[-_]hub:", "", pretrained, flags=re.IGNORECASE).split("@", 1)[0]
        return base if is_hub_id(base) else None
    try:
        cfg = get_pretrained_cfg(pretrained) if kind == "name" else None
    except RuntimeError:  # a tag timm does not have
        return None
    return cfg.hf_hub_id if cfg is not None and is_hub_id(cfg.hf_hub_id) else None


def is_hub_id(text: object) -> bool:
    """Whether `text` is a Hub repo id as the Hub spells them: `name` or `org/name`, ASCII letters, digits, `-`, `_`
    and `.`, at most 96 characters each (huggingface_hub's own check); never a path, never two lines."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(text, str) or not text or not text.isascii():
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_dataset(training: dict) -> str | None:
    """The Hub id of the public dataset a run's record names (CIFAR-10: `cifar10`), else None."""
    cifar = training.get("data_module") in ("vit.data.CIFARDataModule", "vit.data.cifar.CIFARDataModule")
    return training["dataset"] if cifar and training.get("dataset") in ("cifar10", "cifar100") else None
