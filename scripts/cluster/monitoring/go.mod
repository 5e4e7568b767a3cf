// Module that brings the Prometheus Operator's CustomResourceDefinitions (its module's
// example/prometheus-operator-crd/) into the cluster lane: nothing is built from it;
// scripts/cluster/cluster.py downloads it through the Go module proxy, checked against go.sum,
// and copies the ServiceMonitor CRD into its cache, which tests/cluster applies to test the
// chart's ServiceMonitor. v0.85.0 is the newest version of this module path the proxy lists.
module gemini.ai/vgpu/scripts/cluster/monitoring

go 1.24.0

require github.com/prometheus-operator/prometheus-operator v0.85.0
