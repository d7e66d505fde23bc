"""The `kvfleet demo` workload, its live run, the offline cache model and the summary."""
