"""Instances found in Kubernetes: Ready pods by label selector, or an InferencePool's, or the ready
endpoints of a Service's EndpointSlices, watched and applied to the running router beside the
configuration's static instances (router/runtime.py).

```
discovery = Discovery(config.discovery, runtime.discovered, metrics)
await supervise("discovery", discovery.run, 1.0, metrics.task_failures)  # a broken watch starts over
```
"""

from router.discovery.watcher import Discovered, Discovery, FleetSink

__all__ = ["Discovered", "Discovery", "FleetSink"]
