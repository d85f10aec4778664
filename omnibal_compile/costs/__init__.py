"""Block costs: profiled here, from rooflines of named GPUs, analytic at paper scale, at any batch shape."""
