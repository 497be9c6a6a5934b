"""Starting the processes of a run: the launcher command for each machine (torch-free),
and the checks each rank makes that it was started as the experiment says."""
