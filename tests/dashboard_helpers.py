"""What the dashboard tests share: the tiny run's options, and readers of what W&B and TensorBoard wrote."""

from __future__ import annotations

from pathlib import Path

TINY = [
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.log_every_n_steps=1",
    "--data.init_args.num_train=64",
    "--data.init_args.num_val=48",
    "--data.init_args.num_test=32",
    "--data.init_args.batch_size=16",
    "--model.backbone.init_args.embed_dim=16",
    "--model.backbone.init_args.depth=2",
    "--model.backbone.init_args.num_heads=2",
    "--model.backbone.init_args.patch_size=8",
]


def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file.

    The file is a 7-byte header (":W&B", magic, version) followed by LevelDB-log framing: 32 KiB
    blocks of chunks, each a 7-byte header (CRC32, little-endian length, type) and its payload;
    type 1 is a whole record, 2 / 3 / 4 the first / middle / last piece of one.
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    return [wandb_internal_pb2.Record.FromString(r) for r in records]


def hparams_plugin_data(events) -> dict:
    """The hparams plugin's records of a run: {"experiment": ..., "session_start_info": ..., ...} as protos."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    records = {}
    for tag, content in events.PluginTagToContent("hparams").items():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        records[tag.removeprefix("_hparams_/")] = getattr(data, data.WhichOneof("data"))
    return records
