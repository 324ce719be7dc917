"""mnistquick: a Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from mnistquick.task import Net, load_data
from mnistquick.task import train as train_fn

# Flower ClientApp
app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on local data."""
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())

    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    rc = context.run_config
    server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
    loader = load_data(
        partition_id, num_partitions, int(rc["batch-size"]), str(rc["data-dir"]), int(rc["seed"]) + server_round
    )  # type: ignore[arg-type]

    train_loss = train_fn(model, loader, int(rc["local-epochs"]), float(msg.content.config_records["config"]["lr"]))  # type: ignore[arg-type]

    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": train_loss, "num-examples": len(loader.dataset)}),  # type: ignore[arg-type]
        }
    )
    return Message(content=content, reply_to=msg)
