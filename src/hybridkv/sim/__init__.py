"""The workload simulator: workloads and traces, a GPU cost model, and the simulation loop."""
