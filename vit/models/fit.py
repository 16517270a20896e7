"""Whether a state dict fits a model, as every loader of weights checks it (`vit.models.pretrained` for
`--model.pretrained`, `vit.artifact` for a model folder): each tensor of its parameter's kind (`check_kinds`), the
model's names and shapes (`check_names_and_shapes`), and finite in the model's dtypes (`in_model_dtypes`).
The tensors may sit on the meta device: the first two checks read only names, shapes and dtypes."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from vit.models.weight_files import PretrainedError


def kind(dtype: torch.dtype) -> str:
    """The kind of number a tensor of `dtype` holds, as messages name it."""
    if dtype.is_floating_point:
        return "floating-point number"
    return "complex number" if dtype.is_complex else "boolean" if dtype == torch.bool else "integer"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_kinds(state: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor], name: str) -> None:
    """Refuse a tensor of `state` whose kind of number is not its parameter's in `ours`: integers or booleans would
    load as their values into a float parameter, and back."""
    for key in sorted(set(state) & set(ours)):
        theirs, here = kind(state[key].dtype), kind(ours[key].dtype)
        if theirs != here:
            raise PretrainedError(
                f"{name} is unusable: {key} is a tensor of {theirs}s ({dtype_name(state[key].dtype)}) in the weights "
                f"and of {here}s ({dtype_name(ours[key].dtype)}) in this model; it is refused, not converted"
            )


def check_names_and_shapes(
    state: Mapping[str, torch.Tensor],
    ours: Mapping[str, torch.Tensor],
    name: str,
    what: str = "this config",
    fresh: Collection[str] = (),
) -> None:
    """Refuse `state` unless it has the tensors of `ours`, in their shapes, and no others; the `fresh` ones (a head
    left to initialise) may be missing or of another shape. The message counts them all and names the first few."""
    common = set(ours) & set(state)
    missing, unexpected = sorted(set(ours) - set(state) - set(fresh)), sorted(set(state) - set(ours))
    reshaped = sorted(key for key in common if tuple(ours[key].shape) != tuple(state[key].shape))
    if missing or unexpected or reshaped:
        details = [f"{k}: {tuple(state[k].shape)} in the weights, {tuple(ours[k].shape)} here" for k in reshaped[:4]]
        details += [f"{k} missing from the weights" for k in missing[:4]]
        details += [f"{k} not in this model" for k in unexpected[:4]]
        raise PretrainedError(
            f"{name} does not fit {what} ({len(missing) + len(unexpected) + len(reshaped)} tensors differ): "
            + "; ".join(details)
        )


def in_model_dtypes(
    state: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor], name: str
) -> dict[str, torch.Tensor]:
    """`state`'s tensors that `ours` has, converted to its dtypes; refused when one is not finite as converted (a
    float64 1e300 is inf as float32), the value `load_state_dict` would copy in."""
    converted = {}
    for key, tensor in state.items():
        if key not in ours:
            continue
        value = tensor.to(ours[key].dtype)
        if value.is_floating_point() and not torch.isfinite(value).all():
            bad = int((~torch.isfinite(value)).sum())
            raise PretrainedError(
                f"{name} is unusable: {key} holds {bad} of {value.numel()} values that are not finite as this "
                f"model's {dtype_name(value.dtype)} (the weights' {dtype_name(tensor.dtype)} values are beyond its "
                "range)"
            )
        converted[key] = value
    return converted
