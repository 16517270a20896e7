"""What the training code and the callbacks read in a LightningModule or data module (`vit.training.contract`) and
in a backbone from timm (`vit.models.contract`'s timm protocols): this project's classes keep it, a user's module
that declares part of it gets that part, and one that declares none gets a one-line refusal, not a probe that
silently finds nothing."""

from __future__ import annotations

import lightning as L
import pytest
import timm
import torch
from torch import nn

from vit.data.base import SplitDataModule
from vit.explain.relevance import relevance, usable_methods
from vit.models import ConvNet, VisionTransformer
from vit.models.contract import Classifies, ExemptsFromDecay, GroupsLayers
from vit.training.classifier import ImageClassifier, explained_network
from vit.training.contract import DeclaresInputs, NamesClasses, class_names_of
from vit.training.optim import freeze

VIT = dict(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3)


class Wrapper(L.LightningModule):
    """A user's own LightningModule with the network under a name of its choosing."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = nn.CrossEntropyLoss()  # a child that is not a backbone comes first
        self.net = VisionTransformer(**VIT)
        self.class_names = ("cat", "dog", "eel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_the_explained_network_is_the_classifiers_backbone_its_ema_or_a_users_wrapped_backbone():
    torch.manual_seed(0)
    classifier = ImageClassifier(VisionTransformer(**VIT), ema_decay=0.9)
    assert explained_network(classifier) is classifier.backbone
    assert explained_network(classifier, evaluated=True) is classifier.ema.module
    wrapper = Wrapper()
    assert explained_network(wrapper) is wrapper.net
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(
        relevance(explained_network(wrapper), x, "rollout"), relevance(wrapper.net, x, "rollout")
    )
    bare = nn.Sequential(nn.Flatten(), nn.Linear(768, 3))
    assert explained_network(bare) is bare
    with pytest.raises(TypeError, match=r"^Sequential is not a vit.models.contract.Backbone: the relevance methods"):
        usable_methods(explained_network(bare), ["rollout"])


def test_class_names_come_from_what_a_module_declares_and_from_nothing_else():
    assert class_names_of(Wrapper()) == ["cat", "dog", "eel"]  # a tuple is read as the list the reports use
    assert class_names_of(ImageClassifier(ConvNet(num_classes=2, widths=(4,)))) == ["0", "1"]
    assert class_names_of(L.LightningDataModule()) is None
    unknown = L.LightningModule()
    unknown.class_names = None
    assert isinstance(unknown, NamesClasses) and class_names_of(unknown) is None
    assert issubclass(SplitDataModule, DeclaresInputs)  # a method protocol is checked on the class too


def test_timms_models_and_this_projects_keep_the_timm_interface_training_reads():
    for model in (timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3), VisionTransformer(**VIT)):
        assert isinstance(model, Classifies) and model.num_classes == 3
        assert isinstance(model, GroupsLayers) and isinstance(model, ExemptsFromDecay)
    cnn = ConvNet(num_classes=3, widths=(4,))
    assert isinstance(cnn, Classifies) and not isinstance(cnn, GroupsLayers)
    with pytest.raises(ValueError, match=r"^layer_decay=0.75 needs a backbone with timm's `group_matcher` .*ConvNet"):
        ImageClassifier(cnn, layer_decay=0.75)
    with pytest.raises(ValueError, match=r"^backbone Linear must have an int attribute `num_classes`$"):
        ImageClassifier(nn.Linear(2, 3))


def test_freezing_reads_timms_child_names_in_timms_models_and_in_this_projects():
    for model in (timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3), VisionTransformer(**VIT)):
        freeze(model, 1)
        trainable = {name.split(".")[0] for name, p in model.named_parameters() if p.requires_grad}
        assert trainable == {"blocks", "norm", "head"} or trainable == {"blocks", "fc_norm", "head"}
        assert [i for i, block in enumerate(model.blocks) if block.norm1.weight.requires_grad] == [
            len(model.blocks) - 1
        ]
    with pytest.raises(ValueError, match=r"^trainable=1 counts Transformer blocks; ConvNet has no `blocks`$"):
        freeze(ConvNet(num_classes=3, widths=(4,)), 1)
    with pytest.raises(ValueError, match=r"^trainable='head' needs a backbone with a `head`; Linear has none$"):
        freeze(nn.Linear(2, 3), "head")
