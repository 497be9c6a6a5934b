"""What a run tells its user: the environment record and the start and end summaries
(summary.py), loss curves (plots.py), the experiment trackers (trackers.py). Torch-free at
import; imports config, rundir, fileio and errors."""
