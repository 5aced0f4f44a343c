// Validates ServiceMonitors (a JSON list on stdin) against the Prometheus Operator's CRD schema, as compiled by
// @kubernetes-models/prometheus-operator; prints one list of error messages per document. Run with its
// node_modules' directory as the working directory (tests/deploy/chart.py).
import { readFileSync } from "node:fs";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const errors = JSON.parse(readFileSync(0, "utf8")).map((doc) => {
  try {
    new ServiceMonitor(doc).validate();
    return [];
  } catch (error) {
    return [error.message];
  }
});
process.stdout.write(JSON.stringify(errors));
