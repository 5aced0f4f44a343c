"""Instances found in Kubernetes: Ready pods by label selector, or an InferencePool's, or the ready
endpoints of a Service's EndpointSlices, watched and applied to the running router beside the
configuration's static instances (router/runtime.py).

```
from router.discovery.watcher import Discovery

discovery = Discovery(config.discovery, runtime.discovered, metrics)
await supervise("discovery", discovery.run, 1.0, metrics.task_failures)  # a broken watch starts over
```
"""

# The watcher is imported from router/discovery/watcher.py, not here: router/config.py imports this package's
# settings, and the watcher imports router/config.py.
