"""The relevance methods and their facts, in one table that `vit.explain.relevance`, the callbacks, the commands and
the studies read, and the colour scales a grid of maps can share (`vit.explain.plot`); without importing torch, so
that `python -m vit.explain --help` lists them before anything heavy is loaded. A new method is a row here and a
branch of `relevance` (docs/code.md)."""

from dataclasses import dataclass
from typing import Literal, get_args


@dataclass(frozen=True)
class MethodFacts:
    """`attention`: it reads attention maps, so only a backbone with attention layers runs it (`has_attention`);
    `class_specific`: it explains `target` (the prediction by default), where the others give one map for every
    class; `baseline`: a chance reference to score the others against, not an explanation ("all" leaves it out)."""

    attention: bool
    class_specific: bool
    baseline: bool = False


FACTS = {
    "attention": MethodFacts(attention=True, class_specific=False),
    "rollout": MethodFacts(attention=True, class_specific=False),
    "grad_rollout": MethodFacts(attention=True, class_specific=True),
    "flow": MethodFacts(attention=True, class_specific=False),
    "chefer": MethodFacts(attention=True, class_specific=True),
    "gradcam": MethodFacts(attention=False, class_specific=True),
    "random": MethodFacts(attention=False, class_specific=False, baseline=True),
}
METHODS = tuple(FACTS)
Method = Literal[METHODS]  # the names as a type, for jsonargparse and the signatures
ATTENTION_METHODS = tuple(name for name, facts in FACTS.items() if facts.attention)
CLASS_METHODS = tuple(name for name, facts in FACTS.items() if facts.class_specific)

# One colour scale per map ("panel"), per image's row of methods ("row"), or for the whole grid ("figure").
ColourScale = Literal["panel", "row", "figure"]
SCALES = get_args(ColourScale)
