"""ClientApp: LeNet5 training on this SuperNode's partition. ``compression_mod`` rebuilds the model
from the compressed downlink before ``train`` runs and compresses the update after; messages
without fedcomp records (``compress = false``) pass through it untouched."""

from flwr.clientapp import ClientApp

from fedcomp.app.apps import client_train
from fedcomp.flower.mod import compression_mod

app = ClientApp(mods=[compression_mod])
app.train()(client_train)
