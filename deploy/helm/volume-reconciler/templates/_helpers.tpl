{{/*
The app's name: app.kubernetes.io/name on every object, as the base has it
(the ServiceMonitor in deploy/observability selects by it).
*/}}
{{- define "volume-reconciler.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The objects' name: the release's, with the chart's appended unless the
release's already holds it. A release named volume-reconciler gets the
base's names exactly (volume-reconciler, volume-reconciler-admin, ...).
*/}}
{{- define "volume-reconciler.fullname" -}}
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

{{/*
Helm's standard labels beside the base's app.kubernetes.io/name (and the
component, which each template adds).
*/}}
{{- define "volume-reconciler.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "volume-reconciler.selectorLabels" . }}
{{- end }}

{{/*
What selectors match: the base's name, and the release, so that two
releases in one namespace never select each other's pods.
*/}}
{{- define "volume-reconciler.selectorLabels" -}}
app.kubernetes.io/name: {{ include "volume-reconciler.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The server's pods, as the Deployment labels them. */}}
{{- define "volume-reconciler.serverSelectorLabels" -}}
{{ include "volume-reconciler.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{/* The Secret whose keys are serve's environment (DATABASE_URL, tokens, OS_*). */}}
{{- define "volume-reconciler.secretName" -}}
{{- default (include "volume-reconciler.fullname" .) .Values.secret.name }}
{{- end }}

{{- define "volume-reconciler.cloudsSecretName" -}}
{{- default (printf "%s-clouds" (include "volume-reconciler.fullname" .)) .Values.clouds.secretName }}
{{- end }}

{{- define "volume-reconciler.configMapName" -}}
{{- printf "%s-config" (include "volume-reconciler.fullname" .) }}
{{- end }}

{{- define "volume-reconciler.serviceAccountName" -}}
{{- default (include "volume-reconciler.fullname" .) .Values.serviceAccount.name }}
{{- end }}

{{- define "volume-reconciler.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- define "volume-reconciler.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "volume-reconciler.imageTag" .) }}
{{- end }}

{{/*
The pods' security context, shared by the server and the migrate Job
(the base writes the same one in both).
*/}}
{{- define "volume-reconciler.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext }}
{{- end }}

{{/* The container's Secret reference for DATABASE_URL (server and Job). */}}
{{- define "volume-reconciler.databaseUrlEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "volume-reconciler.secretName" . }}
      key: DATABASE_URL
{{- end }}

{{/* The migrate Job's name: the release it migrates to, as the base's. */}}
{{- define "volume-reconciler.migrateJobName" -}}
{{- printf "%s-migrate-%s" (include "volume-reconciler.fullname" .) (include "volume-reconciler.imageTag" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
config.toml from .Values.config, by hand rather than with toToml: Helm
reads a values file's numbers as floats, which toToml writes as 200.0, and
serve's integer settings refuse a float. Strings are written as JSON
strings (a TOML basic string: the same escapes).
*/}}
{{- define "volume-reconciler.configToml" -}}
{{- range $key, $value := .Values.config }}
{{- if not (regexMatch "^[A-Za-z0-9_-]+$" $key) }}
{{- fail (printf "config: %q is not a flag name (docs/operating.md, \"Configuration\")" $key) }}
{{- else if kindIs "string" $value }}
{{ $key }} = {{ toJson $value }}
{{- else if kindIs "bool" $value }}
{{ $key }} = {{ $value }}
{{- else if or (kindIs "float64" $value) (kindIs "int64" $value) (kindIs "int" $value) }}
{{- if eq (float64 $value) (float64 (int64 $value)) }}
{{ $key }} = {{ int64 $value }}
{{- else }}
{{ $key }} = {{ $value }}
{{- end }}
{{- else }}
{{- fail (printf "config.%s: %v is not a setting's value (a string, a number, true or false)" $key $value) }}
{{- end }}
{{- end }}
{{- end }}
