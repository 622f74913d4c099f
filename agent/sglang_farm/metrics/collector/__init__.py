"""collector: one module per section of the farm's `/metrics`, as node_exporter has one per
collector; `metrics.collectors` lists them in exposition order (`sections`)."""
