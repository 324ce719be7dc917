"""ClientApp: LeNet5 training on this SuperNode's partition. The compression mod rebuilds the model
from the compressed downlink before ``train`` runs and compresses the update after; messages
without fedcomp records (``compress = false``) pass through it untouched. It builds the seeded
initial model itself, so with ``seeded-initial-model = true`` no initial model is sent."""

from flwr.clientapp import ClientApp

from fedcomp.app.apps import client_initial_model, client_train
from fedcomp.flower.mod import make_compression_mod
from fedcomp.flower.sampling import add_partition_query

app = ClientApp(mods=[make_compression_mod(initial_model=client_initial_model)])
app.train()(client_train)
add_partition_query(app)  # the server asks each node its partition, to sample clients reproducibly
