"""Starting the processes of a run on this machine: the device probe (probe.py), the wait
for the main machine (rendezvous.py), CPU threads shared out (threads.py), and signals
forwarded to the training processes (forward.py). Torch-free; imports config, run's
launch checks (run/launched.py) and errors."""
