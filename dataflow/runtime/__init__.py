"""Worker-side runtime: the plugin, replicas, process groups and the allreduce."""
