"""mnistquick: a Flower / PyTorch app."""

import json
import random
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from mnistquick.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    rc = context.run_config
    num_rounds = int(rc["num-server-rounds"])  # type: ignore[arg-type]
    fraction_evaluate = float(rc["fraction-evaluate"])  # type: ignore[arg-type]
    torch.manual_seed(int(rc["seed"]))  # type: ignore[arg-type]
    random.seed(int(rc["seed"]))  # type: ignore[arg-type]  # FedAvg samples clients with `random`

    # Load global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize FedAvg strategy
    strategy = CompressionStrategy(FedAvg(fraction_evaluate=fraction_evaluate), CompressionConfig.from_run_config(rc))

    test_loader = load_centralized_dataset(str(rc["data-dir"]))

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate the global model on the MNIST test set."""
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(model, test_loader)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    # Start strategy, run FedAvg for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": float(rc["lr"])}),  # type: ignore[arg-type]
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    # Save the final model and the run's metrics to disk
    out = Path(str(rc["results-dir"]) or "results") / str(rc["run-name"])
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result.arrays.to_torch_state_dict(), out / "final_model.pt")
    rounds = [{"round": r, **dict(m)} for r, m in sorted(result.evaluate_metrics_serverapp.items())]
    train = {str(r): dict(m) for r, m in sorted(result.train_metrics_clientapp.items())}
    (out / "results.json").write_text(
        json.dumps({"status": "completed", "rounds": rounds, "train_metrics": train}, indent=1)
    )
