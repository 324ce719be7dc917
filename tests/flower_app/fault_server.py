"""ServerApp of the fault-injection test app: FedAvg over a scripted set of clients per round."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.app.apps import server_main
from fedcomp.app.config import AppConfig

EXTRA_KEYS = ("script", "corrupt-uplink", "corrupt-replica", "huge-uplink", "no-mod", "fail-train")


def _pairs(text: str) -> set[tuple[int, int]]:
    return {(int(r), int(i)) for r, i in (p.split(":") for p in text.split(",") if p)}


class ScriptedFedAvg(FedAvg):
    """FedAvg whose round r trains exactly the clients the script names, with fault flags."""

    def __init__(self, run_config: dict, metrics_fn: Callable) -> None:
        super().__init__(fraction_evaluate=0.0, train_metrics_aggr_fn=metrics_fn)
        self.script = [[int(c) for c in part] for part in str(run_config["script"]).split("|")]
        self.bad_uplink = _pairs(str(run_config["corrupt-uplink"]))
        self.bad_replica = _pairs(str(run_config["corrupt-replica"]))
        self.huge_uplink = _pairs(str(run_config.get("huge-uplink", "")))
        self.no_mod = _pairs(str(run_config.get("no-mod", "")))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        nodes = sorted(grid.get_node_ids())
        msgs = []
        for i in self.script[server_round - 1]:
            cfg = ConfigRecord(dict(config))
            cfg["server-round"] = server_round
            cfg["test-corrupt-uplink"] = (server_round, i) in self.bad_uplink
            cfg["test-corrupt-replica"] = (server_round, i) in self.bad_replica
            cfg["test-huge-uplink"] = (server_round, i) in self.huge_uplink
            cfg["test-no-mod"] = (server_round, i) in self.no_mod
            content = RecordDict({"arrays": arrays, "config": cfg})
            msgs.append(Message(content=content, dst_node_id=nodes[i], message_type=MessageType.TRAIN))
        return msgs


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    def make_inner(cfg: AppConfig, metrics_fn: Callable) -> FedAvg:
        return ScriptedFedAvg(dict(context.run_config), metrics_fn)

    server_main(grid, context, make_inner, extra_keys=EXTRA_KEYS)
