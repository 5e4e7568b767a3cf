{{/*
Labels of every object: the base's part-of label, and Helm's own (chart, manager, version).
The pods' and selectors' labels are the base's alone: a DaemonSet's selector cannot change.
*/}}
{{- define "gemini-vgpu.labels" -}}
app.kubernetes.io/part-of: gemini-vgpu
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* The node pods' labels (name and component select them; instance as in the base). */}}
{{- define "gemini-vgpu.selectorLabels" -}}
app.kubernetes.io/name: gemini-vgpu
app.kubernetes.io/component: node
{{- end }}

{{- define "gemini-vgpu.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}:{{ $tag }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end }}

{{/*
(list $dst $src): $dst with $src merged over it, as YAML. Maps merge key by key; any other
value of $src replaces $dst's, empty lists, false and 0 included (sprig's mergeOverwrite
skips those).
*/}}
{{- define "gemini-vgpu.merge" -}}
{{- $dst := deepCopy (index . 0) -}}
{{- range $key, $value := index . 1 -}}
{{- if and (kindIs "map" $value) (hasKey $dst $key) (kindIs "map" (index $dst $key)) -}}
{{- $_ := set $dst $key (fromYaml (include "gemini-vgpu.merge" (list (index $dst $key) $value))) -}}
{{- else -}}
{{- $_ := set $dst $key $value -}}
{{- end -}}
{{- end -}}
{{- toYaml $dst -}}
{{- end }}

{{/*
The settings the values give the default configuration, in its format, as YAML. logLevel goes
to every section of the file that has a log_level (whatever the programs' sections are
named); `config` is merged last, so it wins over the named values.
*/}}
{{- define "gemini-vgpu.overrides" -}}
{{- $base := fromYaml (.Files.Get "files/default.yaml") -}}
{{- $set := dict "node" (dict "slices_per_gpu" .Values.slicesPerGpu) "devicePlugin" (dict "memory_reserve" .Values.memoryReserve) -}}
{{- if regexMatch "(^|[.])kubernetes[.]io/" .Values.resourceName -}}
{{- fail (printf "resourceName %s: kubernetes.io is Kubernetes' own domain; an extended resource needs another, such as gemini.ai/vgpu" .Values.resourceName) -}}
{{- end -}}
{{- if ne .Values.resourceName (dig "node" "resource_name" "gemini.ai/vgpu" $base) -}}
{{- $_ := set $set.node "resource_name" .Values.resourceName -}}
{{- end -}}
{{- range $section, $settings := $base -}}
{{- if and (kindIs "map" $settings) (hasKey $settings "log_level") -}}
{{- $_ := set $set $section (fromYaml (include "gemini-vgpu.merge" (list (dig $section dict $set) (dict "log_level" $.Values.logLevel)))) -}}
{{- end -}}
{{- end -}}
{{- include "gemini-vgpu.merge" (list $set .Values.config) -}}
{{- end }}

{{/*
(list $ $overrides): one named configuration's file, the default file with $overrides merged
over it; the default file itself, comments and all, where that changes nothing.
*/}}
{{- define "gemini-vgpu.configFile" -}}
{{- $root := index . 0 -}}
{{- $text := $root.Files.Get "files/default.yaml" -}}
{{- $base := fromYaml $text -}}
{{- $merged := fromYaml (include "gemini-vgpu.merge" (list $base (index . 1))) -}}
{{- if deepEqual $merged $base -}}
{{ $text }}
{{- else -}}
# daemonset/base/config/default.yaml with the Helm release's settings merged over it
# (helm get values); what each key means is said there.
{{ toYaml $merged }}
{{- end -}}
{{- end }}

{{/* The ConfigMap of named configurations: its data. */}}
{{- define "gemini-vgpu.configData" -}}
{{- $overrides := fromYaml (include "gemini-vgpu.overrides" .) -}}
{{- if hasKey .Values.nodeConfigs "default" -}}
{{- fail "nodeConfigs: \"default\" is the default configuration; set its keys with config, slicesPerGpu, memoryReserve, resourceName, logLevel" -}}
{{- end -}}
default.yaml: {{ include "gemini-vgpu.configFile" (list . $overrides) | quote }}
{{- range $name, $settings := .Values.nodeConfigs }}
{{ $name }}.yaml: {{ include "gemini-vgpu.configFile" (list $ (fromYaml (include "gemini-vgpu.merge" (list $overrides ($settings | default dict))))) | quote }}
{{- end }}
{{- end }}

{{/* The telemetry ConfigMap's data: GEMINI_* variables of the node daemon. */}}
{{- define "gemini-vgpu.telemetryData" -}}
GEMINI_MQTT_URL: {{ .Values.mqtt.url | quote }}
{{- if not (kindIs "invalid" .Values.mqtt.topicPrefix) }}
GEMINI_MQTT_TOPIC_PREFIX: {{ .Values.mqtt.topicPrefix | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.mqtt.interval) }}
GEMINI_MQTT_INTERVAL: {{ .Values.mqtt.interval | quote }}
{{- end }}
{{- end }}

{{/*
Generated ConfigMaps are named, as kustomize's generator names them, with a hash of their
content: an edit makes a new name, which rolls the DaemonSet out node by node.
*/}}
{{- define "gemini-vgpu.configName" -}}
gemini-vgpu-config-{{ include "gemini-vgpu.configData" . | sha256sum | trunc 10 }}
{{- end }}
{{- define "gemini-vgpu.telemetryName" -}}
gemini-vgpu-telemetry-{{ include "gemini-vgpu.telemetryData" . | sha256sum | trunc 10 }}
{{- end }}

{{/* The annotations of the uninstall hook's objects (templates/uninstall.yaml), given the weight. */}}
{{- define "gemini-vgpu.uninstallHook" -}}
helm.sh/hook: pre-delete
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end }}
