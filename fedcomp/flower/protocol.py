"""Record and config keys shared by the strategy wrapper (server) and the client mod."""

#: ConfigRecord the server adds to every train/evaluate message: how to rebuild the model.
DOWNLINK = "fedcomp.downlink"
#: ConfigRecord the client mod puts in a train reply: the compressed update.
UPLINK = "fedcomp.uplink"
#: Train-config key for this round's local iterations (temporal sparsity).
LOCAL_ITERS = "local-iters"

# context.state records kept by the client mod across rounds.
STATE_REPLICA = "fedcomp.replica"
STATE_RESIDUAL = "fedcomp.residual"
STATE_META = "fedcomp.meta"
#: The mod's own measurements for the bandwidth policy (seconds per local iteration).
STATE_BANDWIDTH = "fedcomp.methods.bandwidth"
