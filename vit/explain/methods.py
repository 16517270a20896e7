"""The names of the relevance methods (`vit.explain.relevance` computes them), without importing torch:
`python -m vit.explain --help` lists them before anything heavy is loaded."""

from typing import Literal, get_args

Method = Literal["attention", "rollout", "grad_rollout", "flow", "chefer", "gradcam", "random"]
METHODS = get_args(Method)
ATTENTION_METHODS = ("attention", "rollout", "grad_rollout", "flow", "chefer")
CLASS_METHODS = ("grad_rollout", "chefer", "gradcam")  # they explain `target`; the others are class-agnostic
