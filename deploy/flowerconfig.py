# Flower settings for Kiln (mounted at /etc/kiln/flowerconfig.py). Basic auth comes from the
# FLOWER_BASIC_AUTH environment variable; Flower is a debugging view, the job store is the truth.
import os

address = "0.0.0.0"
port = 5555
persistent = True
db = "/var/lib/flower/flower.db"
state_save_interval = 60000
read_only = True
purge_offline_workers = 3600
max_tasks = 20000
enable_events = True
# Run by hand without FLOWER_BASIC_AUTH, Flower would answer anyone on the network: listen on
# loopback only then (compose always sets FLOWER_BASIC_AUTH and publishes the port on 127.0.0.1).
if not os.environ.get("FLOWER_BASIC_AUTH"):
    address = "127.0.0.1"
