{{/* Names and labels shared by every object of the release. */}}

{{- define "xlb.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "xlb.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "xlb.selectorLabels" -}}
app.kubernetes.io/name: {{ include "xlb.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "xlb.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: xlb
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "xlb.selectorLabels" . }}
{{- end -}}

{{- define "xlb.serviceAccountName" -}}
{{- default (include "xlb.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "xlb.image" -}}
{{- printf "%s:%s" .repository (default .appVersion .tag) -}}
{{- end -}}

{{/*
The metrics port: config.metrics_addr's ("0.0.0.0:9469", "[::]:9469") when
set, else metrics.port.
*/}}
{{- define "xlb.metricsPort" -}}
{{- with .Values.config.metrics_addr -}}{{ regexFind "[0-9]+$" . }}{{- else -}}{{ int .Values.metrics.port }}{{- end -}}
{{- end -}}

{{/*
The host the kubelet probes. Without config.metrics_addr the agent listens
on the node's address (status.hostIP), which is the pod's IP on the host
network and so the probes' default: none. With it, the pod's (node's)
address when it is every address, else the address it names (the kubelet
runs in the host's network namespace, as the pod does, so loopback works).
*/}}
{{- define "xlb.probeHost" -}}
{{- with .Values.config.metrics_addr -}}
{{- $host := regexReplaceAll ":[0-9]+$" . "" | trimPrefix "[" | trimSuffix "]" -}}
{{- if not (has $host (list "0.0.0.0" "::")) -}}{{ $host }}{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The port of an agent address field ("10.0.0.1:7946", "[fd00::1]:7946") or,
for an address without one (or none), the default: (list $value $default).
*/}}
{{- define "xlb.portOr" -}}
{{- $v := toString (index . 0 | default "") -}}
{{- if regexMatch "^([0-9.]+|\\[[0-9a-fA-F:.]+\\]):[0-9]+$" $v -}}{{ regexFind "[0-9]+$" $v }}{{- else -}}{{ index . 1 }}{{- end -}}
{{- end -}}

{{/*
A duration of the agent's config in whole seconds, rounded up. The schema
limits such durations to a number with one unit (ms, s or m) so that the
chart can compare them.
*/}}
{{- define "xlb.seconds" -}}
{{- $d := toString . -}}
{{- $n := regexFind "^[0-9]+" $d | atoi -}}
{{- if hasSuffix "ms" $d -}}{{ div (add $n 999) 1000 }}
{{- else if hasSuffix "m" $d -}}{{ mul $n 60 }}
{{- else -}}{{ $n }}
{{- end -}}
{{- end -}}

{{/*
The agent's configuration file: .Values.config plus what the release decides
(the Lease's namespace, the sidecar's API and peers).
*/}}
{{- define "xlb.agentConfig" -}}
{{- $config := deepCopy .Values.config -}}
{{- $kubernetes := get $config "kubernetes" | default dict -}}
{{- $_ := set $kubernetes "lease_namespace" .Release.Namespace -}}
{{- $_ := set $config "kubernetes" $kubernetes -}}
{{- $loadAware := get $config "load_aware" | default dict -}}
{{- if not (hasKey $loadAware "cgroup_root") -}}
{{- $_ := set $loadAware "cgroup_root" "/host/sys/fs/cgroup" -}}
{{- end -}}
{{- $_ := set $config "load_aware" $loadAware -}}
{{- if .Values.bgpSpeaker.enabled -}}
{{- $bgp := get $config "bgp" | default dict -}}
{{- $peers := list -}}
{{- range .Values.bgpSpeaker.peers -}}
{{- $peer := dict "address" .address "asn" .asn -}}
{{- with .holdTime }}{{ $_ := set $peer "hold_time" . }}{{ end -}}
{{- with .keepalive }}{{ $_ := set $peer "keepalive" . }}{{ end -}}
{{- with .multihopTtl }}{{ $_ := set $peer "multihop_ttl" . }}{{ end -}}
{{- with $.Values.bgpSpeaker.gracefulRestart }}{{ $_ := set $peer "graceful_restart" . }}{{ end -}}
{{- $peers = append $peers $peer -}}
{{- end -}}
{{- if eq .Values.bgpSpeaker.speaker "bird" -}}
{{- $_ := set $bgp "driver" "bird" -}}
{{- $_ := set $bgp "asn" (int64 .Values.bgpSpeaker.asn) -}}
{{- $_ := set $bgp "bird" (dict "routes_file" "/run/xlb-bird/xlb-vips" "peers_file" "/run/xlb-bird/bird-peers" "socket" "/run/xlb-bird/bird.ctl") -}}
{{- else if eq .Values.bgpSpeaker.speaker "frr" -}}
{{- $_ := set $bgp "driver" "frr" -}}
{{- $_ := set $bgp "asn" (int64 .Values.bgpSpeaker.asn) -}}
{{- $_ := set $bgp "frr" (dict "socket_dir" "/run/xlb-frr" "config_dir" "/run/xlb-frr" "vtysh" "/run/xlb-frr/vtysh/vtysh") -}}
{{- else -}}
{{- $_ := set $bgp "driver" "gobgp" -}}
{{- $_ := set $bgp "gobgp" (dict "address" (printf "http://127.0.0.1:%d" (int .Values.bgpSpeaker.apiPort))) -}}
{{- end -}}
{{- $_ := set $bgp "peers" $peers -}}
{{- $_ := set $config "bgp" $bgp -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Seconds the agent may spend on shutdown: drain_time (or its default
5s) and graceful_shutdown (default 0s). */}}
{{- define "xlb.drainSeconds" -}}
{{- $bgp := get .Values.config "bgp" | default dict -}}
{{- if or $bgp .Values.bgpSpeaker.enabled -}}
{{- $drain := include "xlb.seconds" (get $bgp "drain_time" | default "5s") | atoi -}}
{{- $graceful := include "xlb.seconds" (get $bgp "graceful_shutdown" | default "0s") | atoi -}}
{{- add $drain $graceful -}}
{{- else -}}0{{- end -}}
{{- end -}}

{{/* BIRD's file: the agent's routes (xlb-vips4, xlb-vips6) and sessions
(bird-peers) included from the volume the agent writes them into;
@ROUTER_ID@ is replaced at start with this node's router id. */}}
{{- define "xlb.birdConfig" -}}
log stderr all;
router id @ROUTER_ID@;
protocol device {}
protocol static xlb_vips4 {
  ipv4;
  include "/run/xlb-bird/xlb-vips4";
}
protocol static xlb_vips6 {
  ipv6;
  include "/run/xlb-bird/xlb-vips6";
}
include "/run/xlb-bird/bird-peers";
{{- end -}}

{{/* FRR's first frr.conf (the agent adds its sessions and VIPs and saves
the whole into it); @ROUTER_ID@ is replaced at start with this node's
router id. Graceful restart as the gobgpd and BIRD sidecars have it: off,
FRR would still offer it as a helper, and the routers would keep a dead
bgpd's routes for 120 s. */}}
{{- define "xlb.frrConfig" -}}
frr defaults traditional
log stdout
!
router bgp {{ int64 .Values.bgpSpeaker.asn }}
 bgp router-id @ROUTER_ID@
{{- with .Values.bgpSpeaker.gracefulRestart }}
 bgp graceful-restart restart-time {{ include "xlb.seconds" . }}
 bgp graceful-restart preserve-fw-state
{{- else }}
 bgp graceful-restart-disable
{{- end }}
exit
{{- end -}}

{{/* gobgpd's file; @ROUTER_ID@ is replaced at start with this node's router id. */}}
{{- define "xlb.gobgpdConfig" -}}
[global.config]
  as = {{ int64 .Values.bgpSpeaker.asn }}
  router-id = "@ROUTER_ID@"
  port = {{ int .Values.bgpSpeaker.listenPort }}
{{- end -}}
