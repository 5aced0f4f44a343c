{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .Values.mode }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Whether the replicas share a store, and whether it is this release's. */}}
{{- define "kvroute.shared" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{- define "kvroute.ownStore" -}}
{{- if and (include "kvroute.shared" .) (not .Values.store.url) }}true{{ end }}
{{- end }}

{{- define "kvroute.storeUrl" -}}
{{- .Values.store.url | default (printf "redis://%s-store:6379/0" (include "kvroute.fullname" .)) }}
{{- end }}

{{/* Its own name: the router's Service, PodDisruptionBudget and pod labels select none of its pods. */}}
{{- define "kvroute.storeSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}-store
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The router's configuration file: .Values.config with the fleet (instances or discovery) and the store. */}}
{{- define "kvroute.config" -}}
{{- $config := deepCopy .Values.config }}
{{- if and (not .Values.discovery.enabled) (empty .Values.instances) }}
{{- fail "a static fleet needs instances (or set discovery.enabled)" }}
{{- end }}
{{- $_ := set $config "instances" (.Values.instances | default list) }}
{{- if .Values.discovery.enabled }}
{{- $discovery := omit .Values.discovery "enabled" | deepCopy }}
{{- if or (eq .Values.discovery.source "inferencepool") (and (eq .Values.discovery.source "endpointslices") .Values.discovery.service) }}
{{- /* the pool's own spec.selector, or the Service's name, picks: the default selector is for pods */}}
{{- $_ := set $discovery "selector" nil }}
{{- end }}
{{- $_ := set $config "discovery" $discovery }}
{{- end }}
{{- if include "kvroute.shared" . }}
{{- $shared := get $config "shared" | default dict }}
{{- $_ := set $shared "url" (include "kvroute.storeUrl" .) }}
{{- $_ := set $config "shared" $shared }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* The namespaces the router reads pods (InferencePools, EndpointSlices) in: discovery's. */}}
{{- define "kvroute.watchedNamespaces" -}}
{{- $namespaces := list }}
{{- if .Values.discovery.enabled }}
{{- $namespaces = append $namespaces (.Values.discovery.namespace | default .Release.Namespace) }}
{{- end }}
{{- $namespaces | toJson }}
{{- end }}
