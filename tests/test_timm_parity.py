"""timm parity for every pooling, registers and QK-norm: same state-dict keys, same features and logits; what does not
fit, refused by name."""

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer as TimmViT

from vit.models import VisionTransformer, record_attention
from vit.models.pretrained import PretrainedError, create_vit

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


def generic(pool: str, **layout) -> tuple[str, dict, dict]:
    """`(timm name, timm's arguments, our options)` for `pool` and `layout` on timm's generic ViT."""
    timm_args = dict(layout, global_pool=TIMM_POOL[pool], class_token=pool == "cls")
    return "vit_tiny_patch16_224", timm_args, dict(layout, pool=pool)


LAYOUTS = [
    {},
    {"reg_tokens": 1},
    {"reg_tokens": 2},
    {"reg_tokens": 4, "no_embed_class": True},
    {"fc_norm": True},
    {"fc_norm": False},
    {"qk_norm": True},
]
PARITY = [generic(pool, **layout) for pool in TIMM_POOL for layout in LAYOUTS] + [
    # timm's own register architectures: their layout comes from the name, shrunk here to SMALL.
    ("vit_base_patch16_reg4_gap_256", {}, dict(pool="mean", reg_tokens=4, no_embed_class=True)),
    ("vit_so150m_patch16_reg4_map_256", {}, dict(pool="map", reg_tokens=4, mlp_ratio=2.572)),
]


@pytest.mark.parametrize(
    "name, timm_args, options", PARITY, ids=["-".join([n, *(f"{k}={v}" for k, v in o.items())]) for n, _, o in PARITY]
)
def test_timms_state_dict_loads_strictly_with_equal_features_and_logits(tmp_path, name, timm_args, options):
    torch.manual_seed(0)
    reference = timm.create_model(name, pretrained=False, **SMALL, **timm_args).eval()
    for p in reference.parameters():  # large enough that every layer, norm gains included, matters
        p.data.normal_(0, 0.3)
    ours = VisionTransformer(**SMALL, **options).eval()
    assert sorted(ours.state_dict()) == sorted(reference.state_dict())
    ours.load_state_dict(reference.state_dict())  # strict
    # The same file through the pretrained loader, as a user reads timm's weights.
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    loaded = create_vit(**SMALL, **options, pretrained=str(path)).eval()
    x = torch.randn(2, 3, 32, 32)
    expected = features_and_logits(reference, x)
    for model in (ours, loaded):
        for a, b in zip(features_and_logits(model, x), expected):
            assert (a - b).abs().max() < 1e-5
    with record_attention(ours):  # the explicit attention path computes timm's numbers too
        assert (features_and_logits(ours, x)[1] - expected[1]).abs().max() < 1e-5
    # The other way round: our checkpoints are timm checkpoints.
    timm.create_model(name, pretrained=False, **SMALL, **timm_args).load_state_dict(
        VisionTransformer(**SMALL, **options).state_dict()
    )  # strict


def test_the_norm_sits_where_timm_puts_it():
    # timm: global_pool="avg" normalises the pooled vector (fc_norm), "token" and "map" the tokens (norm).
    mean, cls, mapped = (VisionTransformer(**SMALL, pool=p) for p in ("mean", "cls", "map"))
    assert "fc_norm.weight" in mean.state_dict() and "norm.weight" not in mean.state_dict()
    for model in (cls, mapped):
        assert "norm.weight" in model.state_dict() and "fc_norm.weight" not in model.state_dict()


def test_register_positions_of_another_layout_are_refused_naming_no_embed_class(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(
        {k: v.contiguous() for k, v in timm_vit("mean", reg_tokens=4, no_embed_class=True).state_dict().items()},
        str(path),
    )
    with pytest.raises(
        PretrainedError,
        match=r"4 register\(s\) and none of them has a position "
        r"\(no_embed_class=True\); this model has num_prefix_tokens=4, "
        r"no_embed_class=False",
    ):
        create_vit(**{**SMALL, "img_size": 64}, pool="mean", reg_tokens=4, pretrained=str(path))


def test_mean_pooling_without_fc_norm_normalises_every_token_then_averages():
    # The relation study's pooling: LayerNorm on every token, then the mean (timm's global_pool="avg", fc_norm=False).
    model = VisionTransformer(**SMALL, pool="mean", fc_norm=False).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model.head(model.norm(_blocks(model, x)).mean(1))
        assert (model(x) - expected).abs().max() < 1e-6
    # The other layout's state dict does not load: its norm sits on the other side of the pooling.
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"norm.weight\""):
        model.load_state_dict(VisionTransformer(**SMALL, pool="mean").state_dict())


def _blocks(model, x):
    x = model.embed(x)
    for block in model.blocks:
        x = block(x)
    return x


def test_bad_register_and_norm_options_name_the_value():
    with pytest.raises(ValueError, match="reg_tokens=-1"):
        VisionTransformer(**SMALL, reg_tokens=-1)
    with pytest.raises(ValueError, match="fc_norm='yes' is not allowed: expected true or false"):
        VisionTransformer(**SMALL, fc_norm="yes")


@pytest.mark.slow
def test_an_old_mean_pooled_checkpoint_is_refused_in_one_line_naming_fc_norm(tmp_path_factory, monkeypatch, capsys):
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
    assert (
        predict_main(["--ckpt_path", str(old), "--input_dir", str(images), "--output", str(images.parent / "p.csv")])
        == 2
    )
    assert "has no model folder beside it" in error_line(capsys.readouterr().err)
    assert not (images.parent / "p.csv").exists()
    config = tiny_config(tmp_path_factory.mktemp("cfg"))
    code, stderr = cli(["test", "--config", str(config), "--ckpt_path", str(old)], monkeypatch, capsys)
    assert code == 2 and "has no model folder beside it" in error_line(stderr)
    # The command that writes an old checkpoint's folder names why it cannot: the weights are not the backbone's.
    from vit.upgrade import main as write_folder

    assert write_folder(["--ckpt_path", str(old)]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(
        f"error: checkpoint {old}: its state_dict does not fit its backbone VisionTransformer: "
        'Missing key(s) in state_dict: "fc_norm.weight", "fc_norm.bias"'
    ), line
