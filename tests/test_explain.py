"""Relevance methods against their formulas written out here, attention flow against a brute-force min cut,
Grad-CAM against pytorch-grad-cam, and the scores against hand-made cases."""

import itertools

import numpy as np
import pytest
import torch

from vit.explain.relevance import ATTENTION_METHODS, METHODS, attention_flow, grad_cam, normalise, relevance, to_pixels
from vit.explain.scores import average_precision, deletion_insertion, pointing_game, rank_correlation, relevance_mass
from vit.models import ResNet, VisionTransformer, record_attention


def tiny_vit(pool="cls", seed=0, reg_tokens=0):
    torch.manual_seed(seed)
    return VisionTransformer(
        img_size=16,
        patch_size=4,
        in_chans=1,
        num_classes=3,
        embed_dim=16,
        depth=2,
        num_heads=2,
        pool=pool,
        reg_tokens=reg_tokens,
    ).eval()


def images(B=2, seed=1):
    return torch.randn(B, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
def test_every_method_gives_one_distribution_per_image(method, pool):
    maps = relevance(tiny_vit(pool), images(), method=method)
    assert maps.shape == (2, 4, 4) and (maps >= 0).all()
    torch.testing.assert_close(maps.flatten(1).sum(1), torch.ones(2))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
def test_with_registers_every_method_gives_one_distribution_over_the_patch_grid(method, pool):
    maps = relevance(tiny_vit(pool, reg_tokens=3), images(), method=method)
    assert maps.shape == (2, 4, 4) and (maps >= 0).all()
    torch.testing.assert_close(maps.flatten(1).sum(1), torch.ones(2))


@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
def test_registers_are_read_as_neither_the_cls_token_nor_patches(pool):
    # Tokens [CLS] [2 registers] [16 patches]: the read-out takes the CLS row, the mean of the patch
    # rows, or the MAP query's attention over the patches; the registers' columns are not patches.
    R, model, x = 2, tiny_vit(pool, reg_tokens=2), images()
    with torch.no_grad(), record_attention(model) as maps:
        model(x)
    first = 1 + R if pool == "cls" else R  # the first patch token
    last = maps[-2 if pool == "map" else -1].mean(1)  # (B, N, N), heads averaged
    if pool == "cls":
        expected = last[:, 0, first:]
    elif pool == "mean":
        expected = last[:, first:, first:].mean(1)
    else:
        query = maps[-1].mean(1)[:, 0]  # (B, 16): the query reads the patches only
        expected = torch.einsum("bp,bpq->bq", query, last[:, first:, first:])
    expected = expected / expected.sum(1, keepdim=True)
    torch.testing.assert_close(relevance(model, x, "attention").flatten(1), expected)


def test_attention_is_the_last_blocks_cls_row_heads_averaged():
    model, x = tiny_vit(), images()
    with torch.no_grad(), record_attention(model) as maps:
        model(x)
    expected = maps[-1].mean(1)[:, 0, 1:]  # (B, 16): CLS row over the patches
    expected = expected / expected.sum(1, keepdim=True)
    torch.testing.assert_close(relevance(model, x, "attention").flatten(1), expected)


def test_chefer_follows_the_published_rule():
    model, x = tiny_vit(), images()
    with record_attention(model) as maps:
        logits = model(x)
    target = logits.argmax(-1)
    grads = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), maps)
    R = torch.eye(17).expand(2, 17, 17)
    for A, G in zip(maps, grads):  # R <- R + mean_h((grad A * A)^+) R
        R = R + (G * A).clamp(min=0).mean(1).detach() @ R
    expected = R[:, 0, 1:] / R[:, 0, 1:].sum(1, keepdim=True)
    torch.testing.assert_close(relevance(model, x, "chefer").flatten(1), expected)


def brute_force_max_flow(capacity: np.ndarray, source: int, sink: int) -> float:
    """Max flow = min cut (Ford-Fulkerson's theorem), by trying every cut of a small graph."""
    others = [v for v in range(len(capacity)) if v not in (source, sink)]
    best = np.inf
    for k in range(len(others) + 1):
        for side in itertools.combinations(others, k):
            S = {source, *side}
            best = min(best, sum(capacity[u, v] for u in S for v in range(len(capacity)) if v not in S))
    return best


def flow_network(blocks: list[torch.Tensor]) -> np.ndarray:
    """Attention flow's graph written out, for one sample: node `layer * N + token`; an edge from token j
    of a layer to token i of the next, of capacity (0.5 A + 0.5 I)[i, j] row-normalised (heads averaged);
    the top CLS token feeds the sink, the last node."""
    L, N = len(blocks), blocks[0].shape[-1]
    capacity = np.zeros(((L + 1) * N + 1, (L + 1) * N + 1))
    for layer, attn in enumerate(blocks):
        a = 0.5 * attn[0].mean(0) + 0.5 * torch.eye(N)
        a = (a / a.sum(-1, keepdim=True)).numpy()
        for i in range(N):
            for j in range(N):
                capacity[layer * N + j, (layer + 1) * N + i] = a[i, j]
    capacity[L * N + 0, (L + 1) * N] = 1.0
    return capacity


def test_attention_flow_equals_a_brute_force_min_cut_on_a_tiny_graph():
    torch.manual_seed(0)
    # Two layers of 3 tokens (CLS + a 1x2 grid of patches), one sample.
    blocks = [torch.rand(1, 2, 3, 3).softmax(-1) for _ in range(2)]
    flow = attention_flow(blocks, pool="cls", pool_attn=None, grid=(1, 2))  # (1, 1, 2)
    N, L = 3, 2
    capacity = flow_network(blocks)
    for patch in range(2):
        expected = brute_force_max_flow(capacity, 1 + patch, (L + 1) * N)
        assert abs(float(flow[0, 0, patch]) - expected) < 1e-5


def test_attention_flow_with_a_register_equals_a_brute_force_min_cut():
    torch.manual_seed(2)
    # Two layers of 4 tokens (CLS, a register, a 1x2 grid of patches), one sample: the register is
    # a path between patches and the CLS token, never a source.
    blocks = [torch.rand(1, 2, 4, 4).softmax(-1) for _ in range(2)]
    flow = attention_flow(blocks, pool="cls", pool_attn=None, grid=(1, 2), reg_tokens=1)  # (1, 1, 2)
    N, L = 4, 2
    capacity = flow_network(blocks)
    for patch in range(2):
        expected = brute_force_max_flow(capacity, 2 + patch, (L + 1) * N)
        assert abs(float(flow[0, 0, patch]) - expected) < 1e-5


@pytest.mark.parametrize("model", ["vit", "resnet"])
def test_grad_cam_matches_pytorch_grad_cam(model):
    import cv2
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    torch.manual_seed(0)
    if model == "vit":
        net = tiny_vit()
        layer = net.blocks[-1].norm1

        def reshape(t):
            return t[:, 1:].reshape(t.shape[0], 4, 4, -1).permute(0, 3, 1, 2)
    else:
        net = ResNet(img_size=16, in_chans=1, num_classes=3, widths=(4, 8)).eval()
        layer, reshape = net.stages[-1], None
    x = images()
    target = torch.tensor([0, 2])
    ours = grad_cam(net, x, target).numpy()  # (B, gh, gw), before any rescaling
    with GradCAM(model=net, target_layers=[layer], reshape_transform=reshape) as cam:
        theirs = cam(input_tensor=x, targets=[ClassifierOutputTarget(int(t)) for t in target])  # (B, 16, 16)

    def min_max(a):
        a = a - a.min()
        return a / (a.max() + 1e-7)

    for o, t in zip(ours, theirs):  # pytorch-grad-cam: min-max, resized to the input, min-max again
        np.testing.assert_allclose(min_max(cv2.resize(min_max(o).astype(np.float32), (16, 16))), t, atol=1e-4)


def test_the_cnn_gets_gradcam_and_random_maps_but_no_attention_maps():
    net = ResNet(img_size=16, in_chans=1, num_classes=3, widths=(4, 8)).eval()
    assert relevance(net, images(), "gradcam").shape == (2, 8, 8)
    assert relevance(net, images(), "random").shape == (2, 8, 8)
    with pytest.raises(ValueError, match="method='rollout' needs a model with attention layers"):
        relevance(net, images(), "rollout")


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_attention_methods_on_the_cnn_say_it_has_no_attention_layers_and_what_works(method):
    net = ResNet(img_size=16, in_chans=1, num_classes=3, widths=(4, 8)).eval()
    with pytest.raises(ValueError) as caught:
        relevance(net, images(), method)
    assert str(caught.value) == (
        f"method={method!r} needs a model with attention layers (a ViT); ResNet has none: use 'gradcam' or 'random'"
    )


@pytest.mark.parametrize(
    "method, options, message",
    [
        (
            "chefer",
            {"start_layer": 1},
            "start_layer applies to method='rollout' and 'grad_rollout' only; got method='chefer', start_layer=1",
        ),
        (
            "attention",
            {"discard_ratio": 0.5},
            "head_fusion and discard_ratio apply to method='rollout' only; "
            "got method='attention', head_fusion='mean', discard_ratio=0.5",
        ),
        (
            "flow",
            {"target": 1},
            "target=1 applies to the class-specific methods ['grad_rollout', 'chefer', 'gradcam'] "
            "only; method='flow' is class-agnostic",
        ),
        (
            "rollout",
            {"head_fusion": "median"},
            "head_fusion='median' is not allowed: expected one of ['mean', 'max', 'min']",
        ),
    ],
)
def test_options_a_method_does_not_take_are_refused_before_the_model_runs(method, options, message):
    model = tiny_vit()
    model.forward = None  # calling the model would fail with a TypeError
    with pytest.raises(ValueError) as caught:
        relevance(model, images(), method, **options)
    assert str(caught.value) == message


def test_record_attention_with_grad_checkpointing_records_each_map_once_and_backpropagates():
    model, x = tiny_vit(), images()
    plain_maps, plain_grads = [], []
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        model.zero_grad()
        with record_attention(model) as maps:
            logits = model(x)
        assert len(maps) == 2  # one per block, not one more per recomputation
        map_grads = torch.autograd.grad(logits[:, 0].sum(), maps, retain_graph=True)
        logits.sum().backward()  # outside the context, as a training step would
        assert model.grad_checkpointing is checkpointing  # the setting is given back
        grads = [p.grad.clone() for p in model.parameters()]
        if not checkpointing:
            plain_maps, plain_map_grads, plain_grads = maps, map_grads, grads
    for a, b in zip([*plain_maps, *plain_map_grads, *plain_grads], [*maps, *map_grads, *grads]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_unchanged_by_grad_checkpointing(method):
    model, x = tiny_vit("map"), images()
    plain = relevance(model, x, method)
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(relevance(model, x, method), plain)
    assert model.grad_checkpointing  # still on for training


def test_localisation_scores_on_a_hand_made_case():
    masks = torch.zeros(2, 8, 8, dtype=torch.bool)
    masks[:, :4, :4] = True  # the object: the top-left quadrant
    maps = torch.zeros(2, 2, 2)
    maps[0, 0, 0], maps[0, 1, 1] = 0.75, 0.25  # mostly on the object
    maps[1, 1, 1] = 1.0  # all off it
    torch.testing.assert_close(pointing_game(maps, masks), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(relevance_mass(maps, masks), torch.tensor([0.75, 0.0]))
    ap = average_precision(maps, masks)
    assert ap[0] == pytest.approx(1.0) and ap[1] == pytest.approx(0.25)  # all pixels tie at 0: precision = prevalence
    torch.testing.assert_close(to_pixels(maps, (8, 8)).flatten(1).sum(1), torch.ones(2))


def test_deletion_and_insertion_follow_the_model_written_out():
    class CountsOnes(torch.nn.Module):  # probability of class 1 = fraction of the image's pixels that are 1
        def forward(self, x):
            p = x.flatten(1).mean(1, keepdim=True)
            return torch.log(torch.cat([1 - p, p], 1).clamp(min=1e-9))

    x = torch.zeros(1, 1, 2, 2)
    x[0, 0, 0, :] = 1.0  # the top row is the evidence
    right = torch.tensor([[[1.0, 1.0], [0.0, 0.0]]])  # the relevant cells first
    deletion, insertion = deletion_insertion(CountsOnes(), x, right, target=torch.tensor([1]))
    # deletion: 0.5, 0.25, 0, 0, 0 over fractions 0..1; insertion: 0, 0.25, 0.5, 0.5, 0.5
    assert float(deletion[0]) == pytest.approx(np.trapezoid([0.5, 0.25, 0, 0, 0], np.linspace(0, 1, 5)))
    assert float(insertion[0]) == pytest.approx(np.trapezoid([0, 0.25, 0.5, 0.5, 0.5], np.linspace(0, 1, 5)))


def test_rank_correlation_and_normalise():
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert float(rank_correlation(a, a * 10)[0]) == pytest.approx(1.0)
    assert float(rank_correlation(a, -a)[0]) == pytest.approx(-1.0)
    torch.testing.assert_close(
        normalise(torch.tensor([[0.0, -1.0], [2.0, 0.0]])[None]), torch.tensor([[[0.0, 0.0], [1.0, 0.0]]])
    )


@pytest.mark.parametrize("out", ["maps.txt", "maps"])
def test_the_explain_command_refuses_an_output_format_before_any_work(out, tmp_path, capsys):
    from vit.explain.__main__ import main

    # The checkpoint does not exist either: the format is checked first, before anything is loaded.
    assert main(["--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / out)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    suffix = ".txt" if out == "maps.txt" else "no extension"
    assert line.startswith(
        f"error: --out {tmp_path / out}: {suffix} is not an image format matplotlib writes: "
        "expected a name ending in one of "
    )
    assert ".png" in line and ".pdf" in line and ".svg" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "backbone, methods",
    [("vit", "attention,rollout,chefer,gradcam"), ("cnn", "gradcam,random"), ("convnet", "gradcam,random")],
)
def test_the_explain_command_draws_a_grid_from_any_checkpoint(backbone, methods, tmp_path, monkeypatch, capsys):
    from PIL import Image
    from robust_helpers import main_in_process, tiny_config

    from vit.explain.__main__ import main

    cnn = {"cnn": "vit.models.ResNet", "convnet": "vit.models.ConvNet"}.get(backbone)
    extra = (
        ["--model.backbone.class_path", cnn, "--model.backbone.init_args.widths", "[4, 8]"] if cnn is not None else []
    )
    main_in_process(
        ["fit", "--config", str(tiny_config(tmp_path, max_epochs=1)), "--test_after_fit", "false", *extra], monkeypatch
    )
    [last] = (tmp_path / "runs").glob("tiny/version_0/checkpoints/last.ckpt")
    out = tmp_path / "maps.png"
    assert main(["--ckpt_path", str(last), "--method", methods, "--out", str(out), "--num_images", "3"]) == 0
    width, height = Image.open(out).size
    # 3 rows, image + methods, and the colour bars
    assert width / height == pytest.approx((3 * (1 + len(methods.split(","))) + 0.75) / (3 * 3), rel=0.01)
    assert main(["--ckpt_path", str(last), "--method", methods, "--out", str(out)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err
    if cnn is not None:
        assert main(["--ckpt_path", str(last), "--method", "rollout", "--out", str(tmp_path / "x.png")]) == 2
        message = f"--method 'rollout' needs a model with attention layers (a ViT); {cnn.split('.')[-1]} has none"
        assert message in capsys.readouterr().err
        # 'all': the attention methods skipped, the random baseline left out; the generated test images drawn as
        # the model sees them (one channel).
        drawn = record_grids(monkeypatch)
        assert main(["--ckpt_path", str(last), "--method", "all", "--out", str(tmp_path / "all.png")]) == 0
        assert list(drawn[0]["maps"]) == ["gradcam"] and drawn[0]["images"].shape[1] == 1


@pytest.fixture
def shared_checkpoint(tmp_path_factory, monkeypatch):
    """The session's tiny two-circles ViT (classes "not_diagonal", "diagonal"), trained once for several test files."""
    from robust_helpers import run_dirs, shared_run

    [run_dir] = run_dirs(shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch))
    return run_dir / "checkpoints" / "last.ckpt"


def circle_pngs(folder, n=3):
    """Two-circles images as 8-bit PNGs, and a file that is no image."""
    from PIL import Image

    from vit.data import TwoCirclesDataset

    folder.mkdir()
    dataset = TwoCirclesDataset(num_samples=n, noise=0.0, seed=5)
    for i in range(n):
        pixels = (dataset.images[i, 0].clamp(0, 1).numpy() * 255).round().astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"c{i}.png")
    (folder / "notes.txt").write_text("not an image")
    return folder


def record_grids(monkeypatch) -> list[dict]:
    """Keep what `python -m vit.explain` draws: the images, the maps by column and the row titles."""
    import vit.explain.plot as plot  # the command imports rollout_grid from here when it draws

    drawn, draw = [], plot.rollout_grid
    monkeypatch.setattr(
        plot,
        "rollout_grid",
        lambda images, maps, titles, scale: (
            drawn.append({"images": images, "maps": maps, "titles": titles, "scale": scale}),
            draw(images, maps, titles, scale),
        )[1],
    )
    return drawn


@pytest.mark.slow
def test_the_explain_command_explains_any_image_with_class_names_and_a_target(
    shared_checkpoint, tmp_path, monkeypatch, capsys
):
    from PIL import Image

    from vit.explain.__main__ import main
    from vit.training.classifier import ImageClassifier

    folder, drawn = circle_pngs(tmp_path / "new photos"), record_grids(monkeypatch)
    out = tmp_path / "maps.png"
    assert (
        main(
            [
                "--ckpt_path",
                str(shared_checkpoint),
                "--input_dir",
                str(folder),
                "--method",
                "rollout,chefer",
                "--target",
                "diagonal",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "skipped notes.txt: not a readable image" in capsys.readouterr().err and out.is_file()
    [grid] = drawn
    # The files' own pixels scaled to [0, 1], as the two-circles data was in training; drawn as RGB.
    x = torch.stack(
        [torch.from_numpy(np.array(Image.open(folder / f"c{i}.png"))).float()[None] / 255 for i in range(3)]
    )
    torch.testing.assert_close(grid["images"], x.expand(-1, 3, -1, -1))
    backbone = ImageClassifier.load_from_checkpoint(shared_checkpoint, map_location="cpu", weights_only=True).backbone
    with torch.no_grad():
        probs = backbone.eval()(x).softmax(-1)
    names = ["not_diagonal", "diagonal"]
    for i, title in enumerate(grid["titles"]):
        p = int(probs[i].argmax())
        lines = [f"c{i}.png", f"predicted {names[p]} ({float(probs[i, p]):.2f})"]
        lines += [f"target diagonal ({float(probs[i, 1]):.2f})"] if p != 1 else []
        assert title == "\n".join(lines)
    # The class-specific method explains the target; rollout is the same for every class.
    assert list(grid["maps"]) == ["rollout", "chefer: diagonal"]
    torch.testing.assert_close(grid["maps"]["chefer: diagonal"], relevance(backbone, x, "chefer", 1))
    torch.testing.assert_close(grid["maps"]["rollout"], relevance(backbone, x, "rollout"))

    # One file by --image, the target by its index: the same map as by its name.
    assert (
        main(
            [
                "--ckpt_path",
                str(shared_checkpoint),
                "--image",
                str(folder / "c1.png"),
                "--method",
                "chefer",
                "--target",
                "1",
                "--out",
                str(tmp_path / "one.png"),
            ]
        )
        == 0
    )
    torch.testing.assert_close(drawn[1]["maps"]["chefer: diagonal"], grid["maps"]["chefer: diagonal"][1:2])


@pytest.mark.slow
def test_the_explain_command_draws_the_maps_over_each_photo_in_colour_at_the_models_size(
    shared_checkpoint, tmp_path, monkeypatch
):
    from PIL import Image
    from torchvision.transforms.v2 import functional as TF

    from vit.explain.__main__ import main
    from vit.training.classifier import ImageClassifier

    drawn, photo = record_grids(monkeypatch), tmp_path / "photo.png"
    pixels = np.zeros((48, 40, 3), dtype=np.uint8)  # (H, W, RGB): red left, blue right; the model takes 32 x 32 grey
    pixels[:, :20, 0], pixels[:, 20:, 2] = 200, 120
    Image.fromarray(pixels).save(photo)
    assert (
        main(
            [
                "--ckpt_path",
                str(shared_checkpoint),
                "--image",
                str(photo),
                "--method",
                "rollout",
                "--out",
                str(tmp_path / "maps.png"),
            ]
        )
        == 0
    )
    [grid] = drawn
    # The photo as decoded, resized to the model's input: RGB in [0, 200 / 255], neither grey nor normalised.
    colour = TF.resize(torch.from_numpy(pixels).permute(2, 0, 1), [32, 32], antialias=True).float() / 255
    torch.testing.assert_close(grid["images"], colour[None])
    assert float(grid["images"][0, 0].max()) == pytest.approx(200 / 255) and float(grid["images"][0, 1].max()) == 0
    # The map is the one of the model's own input, the grey image.
    grey = TF.resize(torch.from_numpy(np.array(Image.open(photo).convert("L")))[None], [32, 32], antialias=True)
    backbone = ImageClassifier.load_from_checkpoint(shared_checkpoint, map_location="cpu", weights_only=True).backbone
    torch.testing.assert_close(grid["maps"]["rollout"], relevance(backbone.eval(), grey[None].float() / 255, "rollout"))


@pytest.mark.slow
def test_the_explain_command_leaves_the_random_baseline_out_of_all_unless_named(
    shared_checkpoint, tmp_path, monkeypatch
):
    from vit.explain.__main__ import main

    folder, drawn = circle_pngs(tmp_path / "photos", n=1), record_grids(monkeypatch)
    for method in ("all", "rollout,random"):
        assert (
            main(
                [
                    "--ckpt_path",
                    str(shared_checkpoint),
                    "--input_dir",
                    str(folder),
                    "--method",
                    method,
                    "--out",
                    str(tmp_path / f"{method}.png"),
                ]
            )
            == 0
        )
    assert list(drawn[0]["maps"]) == [m for m in METHODS if m != "random"]
    assert list(drawn[1]["maps"]) == ["rollout", "random"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--target", "cow"],
            "error: --target 'cow' is not a class of this model: expected one of "
            "['not_diagonal', 'diagonal'] or an index in [0, 1]",
        ),
        (
            ["--target", "2"],
            "error: --target '2' is not a class of this model: expected one of "
            "['not_diagonal', 'diagonal'] or an index in [0, 1]",
        ),
        (
            ["--method", "saliency"],
            f"error: --method 'saliency': ['saliency'] is not allowed: expected names from {list(METHODS)} or 'all'",
        ),
    ],
)
def test_the_explain_command_refuses_an_unknown_target_or_method_in_one_line(
    args, message, shared_checkpoint, tmp_path, capsys
):
    from vit.explain.__main__ import main

    folder = circle_pngs(tmp_path / "photos")
    assert (
        main(
            [
                "--ckpt_path",
                str(shared_checkpoint),
                "--input_dir",
                str(folder),
                *args,
                "--out",
                str(tmp_path / "maps.png"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == message and not (tmp_path / "maps.png").exists()


# --- the figure: one colour scale per panel, row or figure; the raw maps saved --------------------------------


def grid_norms(fig, B: int, M: int) -> list[list[tuple[float, float]]]:
    """`(vmin, vmax)` of each overlay of a `rollout_grid` of B rows and M methods (its second image: the map)."""
    panels = fig.axes[: B * (1 + M)]
    return [
        [(ax.images[1].norm.vmin, ax.images[1].norm.vmax) for ax in panels[row * (1 + M) + 1 : (row + 1) * (1 + M)]]
        for row in range(B)
    ]


@pytest.mark.parametrize("scale", ["panel", "row", "figure"])
def test_the_grid_shares_one_colour_scale_per_row_or_figure_with_its_colour_bars(scale):
    from vit.explain.plot import rollout_grid

    torch.manual_seed(0)
    maps = {"rollout": normalise(torch.rand(2, 4, 4)), "chefer": normalise(torch.rand(2, 4, 4) ** 8)}  # (B, gh, gw)
    maps["rollout"][1] *= 3  # not a distribution any more: the second row's scale differs from the first's
    fig = rollout_grid(torch.rand(2, 1, 32, 32), maps, scale=scale)
    norms = grid_norms(fig, B=2, M=2)
    for row in range(2):
        # The map is drawn in inferno, with alpha, over the image as the first column shows it.
        ax = fig.axes[row * 3 + 1]
        np.testing.assert_array_equal(ax.images[0].get_array(), fig.axes[row * 3].images[0].get_array())
        assert (ax.images[1].get_cmap().name, ax.images[1].get_alpha()) == ("inferno", 0.6)
        row_max = max(float(m[row].max()) for m in maps.values())
        for (vmin, vmax), m in zip(norms[row], maps.values()):
            expected = {
                "panel": (float(m[row].min()), float(m[row].max())),
                "row": (0.0, row_max),
                "figure": (0.0, max(float(m.max()) for m in maps.values())),
            }[scale]
            assert (vmin, vmax) == pytest.approx(expected)
    assert (norms[0][0] != norms[0][1]) == (scale == "panel")  # a row shares its scale unless per panel
    assert (norms[0][0] != norms[1][0]) == (scale != "figure")  # rows differ unless one scale for the figure
    # The colour bars after the panels: one per row for per-row scales, else one; each spans its scale.
    bars = fig.axes[2 * 3 :]
    assert len(bars) == (2 if scale == "row" else 1)
    if scale == "panel":
        assert [t.get_text() for t in bars[0].get_yticklabels()] == ["min", "max"]
    else:
        for bar, row in zip(bars, [0, 1]):
            assert bar.get_ylim() == pytest.approx(norms[row][0])


def test_the_grid_refuses_an_unknown_scale():
    from vit.explain.plot import rollout_grid

    with pytest.raises(ValueError, match=r"scale='image' is not allowed: expected one of \['panel', 'row', 'figure'\]"):
        rollout_grid(torch.rand(1, 1, 8, 8), {"rollout": torch.rand(1, 2, 2)}, scale="image")


def test_the_grid_draws_an_image_in_unit_range_as_it_is_in_colour_and_stretches_a_normalised_one():
    from vit.explain.plot import rollout_grid

    torch.manual_seed(0)
    decoded = torch.rand(1, 3, 8, 8) * 0.5 + 0.2  # RGB in [0.2, 0.7]: a dim photo, drawn as it is
    normalised = (decoded - 0.45) / 0.1  # outside [0, 1]: drawn min-max over all its channels
    stretched = (decoded - decoded.min()) / (decoded.max() - decoded.min())
    for images, expected in ((decoded, decoded), (normalised, stretched)):
        fig = rollout_grid(images, {"rollout": torch.rand(1, 2, 2)})
        for ax in fig.axes[:2]:  # the image, and the map's panel under its overlay
            np.testing.assert_allclose(ax.images[0].get_array(), expected[0].permute(1, 2, 0).numpy(), atol=1e-6)


def test_overlay_is_pytorch_grad_cams_show_cam_on_image_with_inferno():
    import cv2
    import torch.nn.functional as F
    from pytorch_grad_cam.utils.image import show_cam_on_image

    from vit.explain.plot import overlay

    torch.manual_seed(0)
    image, patch_map = torch.rand(3, 32, 24) * 0.8 + 0.1, torch.rand(4, 3)  # (C, H, W) in [0, 1], (gh, gw)
    heat = F.interpolate(patch_map[None, None], size=(32, 24), mode="bilinear", align_corners=False)[0, 0]
    mask = ((heat - patch_map.min()) / (patch_map.max() - patch_map.min())).numpy()  # (H, W) in [0, 1]
    theirs = (
        show_cam_on_image(
            image.permute(1, 2, 0).numpy(), mask, use_rgb=True, colormap=cv2.COLORMAP_INFERNO, image_weight=0.4
        )
        / 255
    )  # (H, W, 3), divided by its max
    ours = overlay(image, patch_map, alpha=0.6)
    # Up to OpenCV's and matplotlib's 256-colour tables (one step apart at most) and pytorch-grad-cam's uint8.
    np.testing.assert_allclose(ours / ours.max(), theirs, atol=0.02)


@pytest.mark.parametrize("existing", [True, False])
def test_the_explain_command_refuses_save_maps_it_would_overwrite_or_cannot_write_before_any_work(
    existing, tmp_path, capsys
):
    from vit.explain.__main__ import main

    npz = tmp_path / "maps.npz" if existing else tmp_path / "missing" / "maps.npz"
    if existing:
        npz.write_bytes(b"earlier maps")
    # The checkpoint does not exist either: the file is checked first, before anything is loaded.
    assert (
        main(
            [
                "--ckpt_path",
                str(tmp_path / "missing.ckpt"),
                "--out",
                str(tmp_path / "maps.png"),
                "--save-maps",
                str(npz),
            ]
        )
        == 2
    )
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"error: --save_maps {npz} already exists; pass --overwrite to replace it"
        if existing
        else f"error: --save_maps {npz}: its folder {npz.parent} does not exist"
    )
    assert (npz.read_bytes() == b"earlier maps") if existing else not npz.parent.exists()
    assert not (tmp_path / "maps.png").exists()


@pytest.mark.slow
def test_the_explain_command_saves_the_maps_it_draws_at_the_scale_asked(
    shared_checkpoint, tmp_path, monkeypatch, capsys
):
    from PIL import Image

    from vit.explain.__main__ import main
    from vit.training.classifier import ImageClassifier

    folder, drawn = circle_pngs(tmp_path / "photos"), record_grids(monkeypatch)
    npz, out = tmp_path / "maps.npz", tmp_path / "maps.png"
    args = [
        "--ckpt_path",
        str(shared_checkpoint),
        "--input_dir",
        str(folder),
        "--method",
        "rollout,chefer",
        "--scale",
        "figure",
        "--out",
        str(out),
        "--save-maps",
        str(npz),
    ]
    assert main(args) == 0
    assert drawn[0]["scale"] == "figure"
    x = torch.stack(
        [torch.from_numpy(np.array(Image.open(folder / f"c{i}.png"))).float()[None] / 255 for i in range(3)]
    )
    backbone = ImageClassifier.load_from_checkpoint(shared_checkpoint, map_location="cpu", weights_only=True).backbone
    with torch.no_grad():
        probs = backbone.eval()(x).softmax(-1)
    with np.load(npz) as saved:  # no pickles: plain arrays and strings
        assert saved["methods"].tolist() == ["rollout", "chefer"]
        for method in ("rollout", "chefer"):
            torch.testing.assert_close(torch.from_numpy(saved[method]), relevance(backbone, x, method))
        assert saved["files"].tolist() == ["c0.png", "c1.png", "c2.png"]
        assert saved["predicted"].tolist() == probs.argmax(-1).tolist()
        np.testing.assert_allclose(saved["probability"], probs.max(-1).values.numpy(), rtol=1e-6)
        assert saved["class_names"].tolist() == ["not_diagonal", "diagonal"] and int(saved["target"]) == -1
    before = npz.read_bytes()
    out.unlink()
    assert main(args) == 2  # the maps are never overwritten without --overwrite
    assert "--save_maps" in capsys.readouterr().err and npz.read_bytes() == before and not out.exists()
    assert main([*args, "--overwrite"]) == 0


@pytest.mark.slow
def test_the_explain_command_reports_each_method_as_it_finishes_in_whole_lines(shared_checkpoint, tmp_path, capsys):
    from vit.explain.__main__ import main

    folder = circle_pngs(tmp_path / "photos")
    args = ["--ckpt_path", str(shared_checkpoint), "--input_dir", str(folder), "--method", "rollout,chefer,gradcam"]
    assert main([*args, "--out", str(tmp_path / "maps.png")]) == 0
    err = capsys.readouterr().err  # not a terminal, as a log file: no line redrawn in place
    assert "\r" not in err and err.endswith("\n")
    progress = [line for line in err.splitlines() if line.startswith("explaining ")]
    assert [line.split(",")[0] for line in progress] == [
        f"explaining 3 images: {n}/3 methods ({method})" for n, method in enumerate(["rollout", "chefer", "gradcam"], 1)
    ]
    assert all(" methods/s, about " in line and line.endswith(" s left") for line in progress[:2])
    assert progress[2].endswith(" methods/s")
