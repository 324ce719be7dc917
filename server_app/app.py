"""ServerApp: FedAvg (wrapped in fedcomp's CompressionStrategy unless ``compress = false``) with
centralized evaluation; every round's accuracy, loss and traffic go to
``results/<run-name>/results.json``. The logic lives in :mod:`fedcomp.app.apps`."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedcomp.app.apps import server_main

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    server_main(grid, context)
