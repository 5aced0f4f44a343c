"""The `discovery` section: instances found in Kubernetes (router/discovery/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from router.label_selector import LABEL_KEY, LabelSelector
from router.settings_base import Strict


class DiscoveryPorts(Strict):
    http: int = Field(default=8000, ge=1, le=65535, description="the engines' OpenAI API (vllm serve --port)")
    events: int | None = Field(
        default=5557, ge=1, le=65535, description="their KV-event publisher; null: no events endpoint"
    )
    replay: int | None = Field(
        default=None, ge=1, le=65535, description="their KV-event replay endpoint; null: none"
    )


class DiscoveryConfig(Strict):
    """Instances found in Kubernetes (router/discovery/): Ready pods or endpoints, beside the static
    instances."""

    source: Literal["kubernetes", "inferencepool", "endpointslices"] = Field(
        default="kubernetes",
        description="kubernetes: pods matching selector; inferencepool: the pods of a Gateway API Inference "
        "Extension InferencePool (its spec.selector, its target port as ports.http); endpointslices: the "
        "ready endpoints of a Service's EndpointSlices (discovery.k8s.io/v1), by service or selector",
    )
    namespace: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        description="null: the router pod's own namespace, else default",
    )
    kubeconfig: str | None = Field(
        default=None,
        min_length=1,
        description="a kubeconfig file; null: the in-cluster service account in a pod, else $KUBECONFIG or "
        "~/.kube/config",
    )
    selector: str | None = Field(
        default=None,
        description="source kubernetes: a label selector on pods; endpointslices: on EndpointSlices",
    )
    service: str | None = Field(
        default=None,
        pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$",
        description="source endpointslices: the Service whose slices are read (kubernetes.io/service-name)",
    )
    inferencepool: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        description="source inferencepool: the InferencePool's name (inference.networking.k8s.io/v1, or "
        "inference.networking.x-k8s.io/v1alpha2)",
    )
    ports: DiscoveryPorts = Field(default_factory=DiscoveryPorts)
    models: list[str] | None = Field(
        default=None, min_length=1, description="the models the pods serve; null: every model in models"
    )
    role_label: str | None = Field(
        default=None,
        description="a pod label whose value is prefill, decode or both (llm-d: llm-d.ai/role); source "
        "endpointslices: a label of the slices (the Service's labels); null: both",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        description="each pod's or endpoint's vllm serve --data-parallel-size (a pod's annotation wins)",
    )

    @field_validator("selector")
    @classmethod
    def _label_selector(cls, selector: str | None) -> str | None:
        if selector is not None:
            LabelSelector.parse(selector)
        return selector

    @field_validator("role_label")
    @classmethod
    def _label_key(cls, key: str | None) -> str | None:
        if key is not None and not LABEL_KEY.match(key):
            raise ValueError(f"{key!r} is not a label key")
        return key

    def source_problem(self) -> str | None:
        """What the source lacks or has too much of, with its key under discovery."""
        if self.source != "inferencepool" and self.inferencepool is not None:
            return "inferencepool: only source inferencepool reads a pool"
        if self.source != "endpointslices" and self.service is not None:
            return "service: only source endpointslices reads a Service's slices"
        if self.source == "kubernetes" and self.selector is None:
            return "selector: source kubernetes needs a label selector, such as app=vllm"
        if self.source == "inferencepool":
            if self.inferencepool is None:
                return "inferencepool: source inferencepool needs the pool's name"
            if self.selector is not None:
                return "selector: source inferencepool takes the pool's spec.selector"
        if self.source == "endpointslices" and (self.service is None) == (self.selector is None):
            return "service: source endpointslices takes a service or a selector on the slices, one of them"
        return None
