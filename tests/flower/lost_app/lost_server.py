"""ServerApp of the lost-update test app: CompressionStrategy around a FedAvg that records what it
aggregated and injects the scripted faults' flags into the train config."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy


def tiny_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(40, 50, generator=g) * 0.1,
        "w2": torch.randn(1200, generator=g) * 0.1,
        "b": torch.randn(10, generator=g) * 0.1,
    }


class RecordingFedAvg(FedAvg):
    """FedAvg over every node; records the model W of each round and the arrays (W + update) it
    aggregated per node; round r's message to node index i carries the scripted fault."""

    def __init__(self, faults: dict[tuple[int, int], str]) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=1.0)
        self.faults = faults
        self.models: dict[int, dict[str, torch.Tensor]] = {}
        self.aggregated: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.models[server_round] = tensors_from_record(arrays)
        nodes = sorted(grid.get_node_ids())
        out = []
        for msg in super().configure_train(server_round, arrays, config, grid):
            cfg = ConfigRecord(dict(msg.content.config_records["config"]))
            cfg["test-fault"] = self.faults.get((server_round, nodes.index(msg.metadata.dst_node_id)), "")
            msg.content = RecordDict({**dict(msg.content.items()), "config": cfg})
            out.append(msg)
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            self.aggregated[server_round] = {
                m.metadata.src_node_id: tensors_from_record(m.content.array_records["arrays"])
                for m in replies
                if not m.has_error()
            }
        return arrays, metrics


def parse_faults(text: str) -> dict[tuple[int, int], str]:
    out = {}
    for part in (p for p in text.split(",") if p):
        r, i, kind = part.split(":")
        out[(int(r), int(i))] = kind
    return out


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    run_dir = Path(str(cfg["results-dir"])) / str(cfg["run-name"])
    run_dir.mkdir(parents=True, exist_ok=True)
    inner = RecordingFedAvg(parse_faults(str(cfg["faults"])))
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config({"uplink-codec": cfg["uplink-codec"]}))
    strategy.start(grid, record_from_tensors(tiny_model()), num_rounds=int(cfg["rounds"]))
    torch.save(
        {
            "models": inner.models,
            "aggregated": inner.aggregated,
            "nodes": sorted(grid.get_node_ids()),
            "rejected": {r: dict(t.rejected) for r, t in strategy.traffic.items()},
            "missing": {r: sorted(t.unanswered) for r, t in strategy.traffic.items()},
        },
        run_dir / "server.pt",
    )
    (run_dir / "results.json").write_text(json.dumps({"status": "completed", "error": None, "rounds": []}))
