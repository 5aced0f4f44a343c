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

{{/* The pod labels as a label selector: how the replicas find each other (discovery.peers_selector). */}}
{{- define "kvroute.peersSelector" -}}
{{- $labels := include "kvroute.selectorLabels" . | fromYaml }}
{{- $terms := list }}
{{- range $key := keys $labels | sortAlpha }}
{{- $terms = append $terms (printf "%s=%s" $key (get $labels $key)) }}
{{- end }}
{{- join "," $terms }}
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvroute.peered" -}}
{{- if and .Values.discovery.enabled (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{/* The router's configuration file: .Values.config with the fleet (instances or discovery) and peers. */}}
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
{{- if include "kvroute.peered" . }}
{{- $_ := set $discovery "peers_selector" (include "kvroute.peersSelector" .) }}
{{- $peers := get $config "peers" | default dict }}
{{- $_ := set $peers "publish" (printf "tcp://0.0.0.0:%d" (int .Values.peers.port)) }}
{{- $_ := set $config "peers" $peers }}
{{- end }}
{{- $_ := set $config "discovery" $discovery }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* The namespaces the router reads pods (InferencePools, EndpointSlices) in: discovery's, and its own for
peers. */}}
{{- define "kvroute.watchedNamespaces" -}}
{{- $namespaces := list }}
{{- if .Values.discovery.enabled }}
{{- $namespaces = append $namespaces (.Values.discovery.namespace | default .Release.Namespace) }}
{{- if include "kvroute.peered" . }}
{{- $namespaces = append $namespaces .Release.Namespace }}
{{- end }}
{{- end }}
{{- $namespaces | uniq | toJson }}
{{- end }}
