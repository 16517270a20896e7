"""Every backbone x every relevance method it claims x every door that opens a trained model, as timm runs its tests
over `list_models()`: each public backbone keeps the contract `vit.models.contract.Backbone` declares, and what the
rest of the project builds on it (the method table, the model folder, `vit.load`'s predict and explain) holds for
each."""

from __future__ import annotations

import pytest
import torch

import vit
from vit import artifact
from vit.explain.methods import FACTS, METHODS
from vit.explain.relevance import map_grid, relevance, usable_methods
from vit.models import ConvNet, CoordConvResNet, ResNet, VisionTransformer
from vit.models.contract import Backbone
from vit.models.timm_compat import timm_state_dict
from vit.models.vision_transformer import BOUNDS
from vit.registry import BACKBONES

VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
NAMES = ["a", "b", "c"]

# (class, init_args): every public backbone, the ViT in each pool and with registers, the CNN in each readout.
CASES = {
    "vit-cls": (VisionTransformer, dict(VIT, pool="cls")),
    "vit-cls-registers": (VisionTransformer, dict(VIT, pool="cls", reg_tokens=2)),
    "vit-mean": (VisionTransformer, dict(VIT, pool="mean")),
    "vit-map": (VisionTransformer, dict(VIT, pool="map")),
    "vit-mean-sincos2d": (VisionTransformer, dict(VIT, pool="mean", pos_embed="sincos2d")),
    "convnet-avg": (ConvNet, dict(num_classes=3, widths=(4, 8), strides=(1, 2))),
    "convnet-max": (ConvNet, dict(num_classes=3, widths=(4, 8), pool="max")),
    "convnet-flatten": (ConvNet, dict(num_classes=3, widths=(4, 4), strides=(2, 2), pool="flatten")),
    "resnet": (ResNet, dict(num_classes=3, widths=(4, 8))),
    "coordconv-resnet": (CoordConvResNet, dict(num_classes=3, widths=(4, 8))),
}


def study_vit_case():
    from studies.runner.models import StudyViT  # registers itself (`allow_backbone`) as a study's backbone

    return StudyViT, dict(VIT, pool="mean", attn_radius=1)


def build(name: str) -> tuple[Backbone, dict]:
    cls, args = study_vit_case() if name == "study-vit" else CASES[name]
    torch.manual_seed(0)
    return cls(**args).eval(), args


ALL = [*CASES, "study-vit"]


def test_every_registered_backbone_is_a_backbone_and_every_one_is_tested():
    classes = set(BACKBONES.values())
    assert all(issubclass(cls, Backbone) for cls in classes)
    assert {cls for cls, _ in CASES.values()} >= {cls for cls in classes if cls.__module__.startswith("vit.")}


def test_a_backbone_without_a_gradcam_layer_cannot_be_built_and_is_named():
    class NoTarget(Backbone):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="abstract method 'gradcam_target'|abstract method gradcam_target"):
        NoTarget()


def test_the_method_facts_agree_with_what_each_method_does():
    # The class-specific methods give another map for another target; the others one map for every class.
    model, _ = build("vit-cls")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for method in METHODS:
        if FACTS[method].class_specific:
            zero, one = relevance(model, x, method, target=0), relevance(model, x, method, target=1)
            assert not torch.allclose(zero, one), method
        else:
            with pytest.raises(ValueError, match="applies to the class-specific methods"):
                relevance(model, x, method, target=0)


@pytest.mark.parametrize("name", ALL)
def test_each_backbone_runs_every_method_it_claims_and_refuses_the_others(name):
    model, _ = build(name)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    claimed = usable_methods(model, ["all"])
    assert claimed == [m for m in METHODS if model.has_attention or not FACTS[m].attention]
    grid = map_grid(model, x)
    for method in claimed:
        maps = relevance(model, x, method)
        assert maps.shape == (2, *grid), method
        assert torch.allclose(maps.sum(dim=(1, 2)), torch.ones(2), atol=1e-5), method
        assert (maps >= 0).all(), method
    for method in set(METHODS) - set(claimed):
        with pytest.raises(ValueError, match="needs a model with attention layers"):
            relevance(model, x, method)


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith(("vit", "study"))])
def test_a_vits_prefix_tokens_are_the_tokens_its_attention_sees_beyond_the_patches(name):
    from vit.models import record_attention

    model, _ = build(name)
    with torch.no_grad(), record_attention(model) as maps:
        model(torch.randn(1, 3, 32, 32))
    patches = model.patch_embed.num_patches
    assert maps[0].shape[-1] == model.num_prefix_tokens + patches


def test_a_cnn_has_no_prefix_tokens_and_its_gradcam_grid_is_its_feature_map():
    model, _ = build("convnet-avg")
    assert model.num_prefix_tokens == 0 and not model.has_attention
    x = torch.randn(1, 3, 32, 32)
    assert map_grid(model, x) == tuple(model.forward_features(x).shape[-2:]) == (16, 16)


@pytest.mark.parametrize("name", ALL)
def test_each_backbone_saved_as_a_model_folder_opens_through_vit_load_with_the_same_predictions_and_maps(
    name, tmp_path
):
    model, args = build(name)
    cls = type(model)
    inputs = {"img_size": [32, 32], "in_chans": 3, "mean": [0.5] * 3, "std": [0.25] * 3, "interpolation": "bicubic"}
    backbone = {"class_path": f"{cls.__module__}.{cls.__name__}", "init_args": args}
    folder = artifact.write(
        tmp_path / "model", artifact.describe(model, backbone, inputs, NAMES), timm_state_dict(model)
    )
    predictor = vit.load(folder)
    assert type(predictor.model) is cls
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))  # pixels in [0, 1]
    with torch.no_grad():
        expected = model((x - 0.5) / 0.25).softmax(-1)
    assert (predictor.probabilities((x - 0.5) / 0.25) - expected).abs().max() < 1e-6  # a tensor: model inputs
    for method in usable_methods(model, ["all"]):
        opened = predictor.explain((x[0] - 0.5) / 0.25, method)
        assert torch.allclose(opened, relevance(model, ((x[:1] - 0.5) / 0.25), method)[0], atol=1e-6), method


@pytest.mark.parametrize("key", ["reg_tokens", "depth", "embed_dim", "num_classes"])
def test_a_vit_at_the_bound_of_an_argument_saves_and_opens_and_one_past_it_is_refused(key, tmp_path):
    low, high = BOUNDS[key][:2]
    # The upper bound where it is small enough to build here (1024 registers, 1024 blocks of 8 dims), else the lower.
    value = high if key in ("reg_tokens", "depth") else low
    args = {**VIT, "embed_dim": 8, "num_heads": 1, key: value}
    model = VisionTransformer(**args).eval()
    inputs = {"img_size": [32, 32], "in_chans": 3, "mean": [0.5] * 3, "std": [0.25] * 3, "interpolation": "bicubic"}
    backbone = {"class_path": "vit.models.VisionTransformer", "init_args": args}
    names = [str(i) for i in range(args["num_classes"])]
    config = artifact.describe(model, backbone, inputs, names)
    folder = artifact.write(tmp_path / "model", config, timm_state_dict(model))
    opened = artifact.read(folder)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(opened.model(x), model(x))
    past = high + 1 if value == high else low - 1
    config["vit"]["backbone"]["init_args"][key] = past
    artifact.write(folder, config, timm_state_dict(model))
    with pytest.raises(artifact.ArtifactError, match=f"{key}={past} is not allowed"):
        artifact.read(folder)
