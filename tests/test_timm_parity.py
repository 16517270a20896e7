"""timm parity for every pooling and for registers: same state-dict keys, same features and logits; old layouts."""

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer as TimmViT

from vit.models import VisionTransformer
from vit.models.attention import Attention
from vit.models.pretrained import PretrainedError
from vit.training.classifier import ImageClassifier

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)
TIMM_POOL = {"cls": "token", "mean": "avg", "map": "map"}


def timm_vit(pool: str, **kwargs) -> TimmViT:
    """A timm ViT with `pool`'s `global_pool`, its weights drawn large enough that every layer matters."""
    torch.manual_seed(0)
    model = TimmViT(**SMALL, global_pool=TIMM_POOL[pool], class_token=pool == "cls", **kwargs).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model


def features_and_logits(model, x):
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True), model(x)


@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
@pytest.mark.parametrize("layout", [{}, {"reg_tokens": 2}, {"reg_tokens": 4, "no_embed_class": True},
                                    {"fc_norm": True}, {"fc_norm": False}])
def test_every_pooling_loads_timms_state_dict_strictly_with_equal_features_and_logits(pool, layout):
    reference = timm_vit(pool, **layout)
    ours = VisionTransformer(**SMALL, pool=pool, **layout).eval()
    assert sorted(ours.state_dict()) == sorted(reference.state_dict())
    ours.load_state_dict(reference.state_dict())  # strict
    x = torch.randn(2, 3, 32, 32)
    for a, b in zip(features_and_logits(ours, x), features_and_logits(reference, x)):
        assert (a - b).abs().max() < 1e-5


def test_the_norm_sits_where_timm_puts_it():
    # timm: global_pool="avg" normalises the pooled vector (fc_norm), "token" and "map" the tokens (norm).
    mean, cls, mapped = (VisionTransformer(**SMALL, pool=p) for p in ("mean", "cls", "map"))
    assert "fc_norm.weight" in mean.state_dict() and "norm.weight" not in mean.state_dict()
    for model in (cls, mapped):
        assert "norm.weight" in model.state_dict() and "fc_norm.weight" not in model.state_dict()


@pytest.mark.parametrize("pool, layout", [("mean", {}), ("map", {}), ("mean", {"reg_tokens": 4, "no_embed_class": True}),
                                          ("cls", {"reg_tokens": 4, "no_embed_class": True}), ("cls", {"reg_tokens": 1})])
def test_the_pretrained_loader_reads_timms_pooled_and_register_models(tmp_path, pool, layout):
    # ("mean", reg 4, no_embed_class) is timm's vit_*_reg4_gap layout.
    reference = timm_vit(pool, **layout)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    ours = VisionTransformer(**SMALL, pool=pool, pretrained=str(path), **layout).eval()
    x = torch.randn(2, 3, 32, 32)
    for a, b in zip(features_and_logits(ours, x), features_and_logits(reference, x)):
        assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("name, options", [
    ("vit_base_patch16_reg4_gap_256", dict(pool="mean", reg_tokens=4, no_embed_class=True)),
    ("vit_so150m_patch16_reg4_map_256", dict(pool="map", reg_tokens=4, mlp_ratio=2.572)),
])
def test_timms_register_models_load_through_the_pretrained_loader(tmp_path, name, options):
    # timm's own register architectures (their layout from the name), shrunk to a few layers, random weights.
    torch.manual_seed(0)
    reference = timm.create_model(name, pretrained=False, **SMALL).eval()
    for p in reference.parameters():
        p.data.normal_(0, 0.3)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    ours = VisionTransformer(**SMALL, **options, pretrained=str(path)).eval()
    x = torch.randn(2, 3, 32, 32)
    for a, b in zip(features_and_logits(ours, x), features_and_logits(reference, x)):
        assert (a - b).abs().max() < 1e-5


def test_register_positions_of_another_layout_are_refused_naming_no_embed_class(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in timm_vit("mean", reg_tokens=4, no_embed_class=True).state_dict().items()},
              str(path))
    with pytest.raises(PretrainedError, match=r"4 register\(s\) and none of them has a position "
                                              r"\(no_embed_class=True\); this model has num_prefix_tokens=4, "
                                              r"no_embed_class=False"):
        VisionTransformer(**{**SMALL, "img_size": 64}, pool="mean", reg_tokens=4, pretrained=str(path))


def test_a_mean_pooled_state_dict_from_before_fc_norm_is_refused_naming_the_option():
    # Before fc_norm existed, pool="mean" normalised every token, then averaged: fc_norm=False now.
    old = VisionTransformer(**SMALL, pool="mean", fc_norm=False).eval()
    with pytest.raises(ValueError, match=r"before the pooling \(norm.weight, no fc_norm.weight\).*set fc_norm=False"):
        VisionTransformer(**SMALL, pool="mean").load_state_dict(old.state_dict())
    # ... also inside a Lightning module, where the keys carry the `backbone.` prefix.
    checkpoint = {f"backbone.{k}": v for k, v in old.state_dict().items()}
    with pytest.raises(ValueError, match="set fc_norm=False"):
        ImageClassifier(VisionTransformer(**SMALL, pool="mean")).load_state_dict(checkpoint)
    again = VisionTransformer(**SMALL, pool="mean", fc_norm=False).eval()
    again.load_state_dict(old.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again(x), old(x))
        # Its meaning: LayerNorm on every token, then the mean (the relation study's pooling).
        expected = old.head(old.norm(_blocks(old, x)).mean(1))
        assert (old(x) - expected).abs().max() < 1e-6


def _blocks(model, x):
    x = model.embed(x)
    for block in model.blocks:
        x = block(x)
    return x


def test_an_fc_norm_state_dict_into_a_model_without_fc_norm_is_refused():
    with pytest.raises(PretrainedError, match=r"set fc_norm=True"):
        VisionTransformer(**SMALL, pool="mean", fc_norm=False).load_state_dict(
            VisionTransformer(**SMALL, pool="mean").state_dict())


def test_a_map_head_saved_in_the_old_layout_loads_with_the_same_outputs():
    # The MAP head before it took timm's names: `probe`, and an `Attention` with a fused `qkv` whose
    # query rows read the probe and key/value rows the tokens; then p + mlp(norm(p)).
    torch.manual_seed(1)
    model = VisionTransformer(**SMALL, pool="map").eval()
    dim, pool = SMALL["embed_dim"], model.attn_pool
    old_attn = Attention(dim, num_heads=SMALL["num_heads"]).eval()
    for p in old_attn.parameters():
        p.data.normal_(0, 0.3)
    probe = torch.randn(1, 1, dim)
    old = {k: v for k, v in model.state_dict().items() if not k.startswith("attn_pool.") or ".mlp." in k
           or ".norm." in k}
    old["attn_pool.probe"] = probe
    old.update({f"attn_pool.attn.{k}": v for k, v in old_attn.state_dict().items()})
    model.load_state_dict(old)
    tokens = torch.randn(2, 16, dim)
    with torch.no_grad():
        p = old_attn(probe.expand(2, -1, -1), tokens)  # the old head, literally
        expected = (p + pool.mlp(pool.norm(p)))[:, 0]
        assert (pool(tokens) - expected).abs().max() < 1e-6


def test_bad_register_and_norm_options_name_the_value():
    with pytest.raises(ValueError, match="reg_tokens=-1"):
        VisionTransformer(**SMALL, reg_tokens=-1)
    with pytest.raises(ValueError, match="fc_norm='yes' is not allowed: expected true or false"):
        VisionTransformer(**SMALL, fc_norm="yes")


@pytest.mark.slow
def test_an_old_mean_pooled_checkpoint_is_refused_in_one_line_naming_fc_norm(tmp_path_factory, monkeypatch,
                                                                                   capsys):
    # A checkpoint of `pool: mean` from before fc_norm: its hyperparameters say pool='mean' and nothing
    # of fc_norm, its weights hold `norm.*` (made here from the shared tiny run by removing the CLS token).
    from robust_helpers import cli, error_line, run_dirs, shared_run, tiny_config

    [run_dir] = run_dirs(shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch))
    content = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    init_args = content["hyper_parameters"]["backbone"]["init_args"]
    init_args["pool"] = "mean"
    for new_option in ("fc_norm", "reg_tokens", "no_embed_class"):
        del init_args[new_option]
    state = content["state_dict"]
    del state["backbone.cls_token"]
    state["backbone.pos_embed"] = state["backbone.pos_embed"][:, 1:]
    old = tmp_path_factory.mktemp("old") / "mean_before_fc_norm.ckpt"
    torch.save(content, old)
    # vit.predict rebuilds the model from the checkpoint alone: the same reason, in one line, nothing read.
    from vit.predict import main as predict_main

    images = tmp_path_factory.mktemp("images")
    assert predict_main(["--ckpt_path", str(old), "--input_dir", str(images), "--output",
                         str(images.parent / "p.csv")]) == 2
    line = error_line(capsys.readouterr().err)
    expected = (f"error: checkpoint {old}: state_dict does not fit the backbone its hyper_parameters record "
                "(VisionTransformer): 2 tensor(s) missing, 2 unexpected; first: 'backbone.fc_norm.bias' missing, "
                "'backbone.norm.bias' not in the model")
    assert line == expected
    assert not (images.parent / "p.csv").exists()
    config = tiny_config(tmp_path_factory.mktemp("cfg"))
    code, stderr = cli(["test", "--config", str(config), "--ckpt_path", str(old)], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == expected  # read before anything is built: the same line from every door
