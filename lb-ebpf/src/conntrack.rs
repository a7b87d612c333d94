//! Flow state: the flow table (client -> backend) and the reply table
//! (backend -> client), both shared by all CPUs, and Maglev picks for new
//! flows.

use core::ffi::c_void;

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_loop, programs::XdpContext};
use lb_common::{
    hash::{
        flow_hash, maglev_hash, next_candidate, snat_port_candidate, CANDIDATE_DRAWS,
        LEAST_LOADED_CANDIDATES,
    },
    Backend, Config, Flow, FlowKey, Reason, ReplyNat, ServiceInfo, CLOSED_STALE_NS,
    FLOW_EVENT_REPICKED, FLOW_F_CLOSED, FLOW_F_COUNTED, FLOW_F_HANDED, HANDED_SYN_NS,
    HOLD_UNKNOWN_NS, PROTO_TCP, REPLY_F_CLOSING, SERVICE_F_FLOW_LIMIT, SERVICE_F_HOLD_UNKNOWN,
    SERVICE_F_LEAST_LOADED, SERVICE_F_SNAT, SNAT_PROBES,
};

use crate::{
    maps::{
        BACKENDS, BACKEND_ACTIVE, BACKEND_REVERSE, CONFIG, FLOWS, HELD_FLOWS, MAGLEV, REPLY_NAT,
    },
    parse::Headers,
    scratch::{Scratch, NEW_FLOW, NEW_FLOW_STATELESS},
};

use crate::clock::now;

const NS: u64 = 1_000_000_000;
/// Flow timestamps and reply-entry lifetimes are refreshed at most this often,
/// so an established flow costs no write per packet.
const REFRESH_NS: u64 = NS;

/// Copies an address between two map values. A plain assignment there
/// becomes a call to a byte-by-byte `memmove` (the BPF backend does not
/// inline it: about 110 instructions); a `memcpy` it inlines.
#[inline(always)]
pub fn copy_addr(dst: &mut [u32; 4], src: &[u32; 4]) {
    // SAFETY: two valid references, which Rust guarantees do not overlap.
    unsafe { core::ptr::copy_nonoverlapping(src, dst, 1) }
}

/// `lookup_or_create`'s "no error" return.
pub const FOUND: u32 = u32::MAX;

#[inline(always)]
pub fn config() -> Config {
    CONFIG.get(0).copied().unwrap_or_default()
}

#[inline(always)]
fn lifetime_ns(cfg: &Config, proto: u8, closing: bool) -> u64 {
    let s = if proto != PROTO_TCP {
        cfg.udp_timeout_s
    } else if closing {
        cfg.tcp_closing_timeout_s
    } else {
        cfg.tcp_timeout_s
    };
    s as u64 * NS
}

/// The reply-direction key of a client flow sent to `t`.
/// Writes the reply key in place (no stack temporary).
#[inline(always)]
fn set_reply_key(
    rk: &mut FlowKey,
    key: &FlowKey,
    svc: &ServiceInfo,
    backend: &Backend,
    snat: (&[u32; 4], u16),
) {
    let (snat_addr, snat_port) = snat;
    let snat = svc.flags & SERVICE_F_SNAT != 0;
    copy_addr(&mut rk.src, &backend.addr);
    copy_addr(&mut rk.dst, if snat { snat_addr } else { &key.src });
    rk.sport = backend.port;
    rk.dport = if snat { snat_port } else { key.sport };
    rk.proto = key.proto;
    rk.family = key.family;
    rk._pad = [0; 2];
}

/// Fills a reply translation in place, field by field: whole-struct copies
/// become `memcpy` loops that cost the verifier dearly.
#[inline(always)]
fn set_reply_value(
    r: &mut ReplyNat,
    key: &FlowKey,
    service_id: u32,
    backend_id: u32,
    closing: bool,
    expires_ns: u64,
) {
    copy_addr(&mut r.vip, &key.dst);
    copy_addr(&mut r.client, &key.src);
    r.vport = key.dport;
    r.cport = key.sport;
    r.service_id = service_id;
    r.backend_id = backend_id;
    r.flags = if closing { REPLY_F_CLOSING } else { 0 };
    r.expires_ns = expires_ns;
    r.fib.ifindex = 0;
}

#[inline(always)]
fn same_client(r: &ReplyNat, key: &FlowKey) -> bool {
    r.client == key.src && r.cport == key.sport && r.vip == key.dst && r.vport == key.dport
}

/// The backend Maglev gives this flow now.
#[inline(always)]
pub fn pick(key: &FlowKey, svc: &ServiceInfo) -> Result<(u32, &'static Backend), Reason> {
    if svc.backend_count == 0 || svc.table_size == 0 {
        return Err(Reason::DropNoBackend);
    }
    slot_backend(key, svc, maglev_hash(key, svc.flags))
}

#[inline(always)]
fn slot_backend(
    key: &FlowKey,
    svc: &ServiceInfo,
    hash: u32,
) -> Result<(u32, &'static Backend), Reason> {
    let m = svc.table_size;
    let idx = svc.table_base + svc.active * m + hash % m;
    let id = *MAGLEV.get(idx).ok_or(Reason::DropTableError)?;
    // A reference, not a copy: a copy here is a byte-wise `memmove` call
    // (see `copy_addr`).
    let backend = &BACKENDS.get(id).ok_or(Reason::DropTableError)?.backend;
    if backend.family != key.family {
        return Err(Reason::DropTableError);
    }
    Ok((id, backend))
}

/// A new flow's backend: Maglev's, or for `SERVICE_F_LEAST_LOADED` the one
/// with the fewest open flows among `LEAST_LOADED_CANDIDATES` distinct
/// Maglev candidates (ties: the one drawn first, Maglev's own pick first).
#[inline(always)]
fn pick_new(key: &FlowKey, svc: &ServiceInfo) -> Result<(u32, &'static Backend), Reason> {
    let first = pick(key, svc)?;
    if svc.flags & SERVICE_F_LEAST_LOADED == 0 || svc.backend_count < 2 {
        return Ok(first);
    }
    let open = |id: u32| BACKEND_ACTIVE.get(id).copied().unwrap_or(0);
    let wanted = svc.backend_count.min(LEAST_LOADED_CANDIDATES);
    let (mut best, mut best_open) = (first, open(first.0));
    // The second candidate's id once drawn: the loop holds three.
    const _: () = assert!(LEAST_LOADED_CANDIDATES <= 3);
    let mut second = first.0;
    let mut found = 1;
    let mut h = maglev_hash(key, svc.flags);
    for _ in 0..CANDIDATE_DRAWS {
        h = next_candidate(h);
        let Ok(c) = slot_backend(key, svc, h) else {
            break;
        };
        if c.0 == first.0 || c.0 == second {
            continue;
        }
        second = c.0;
        found += 1;
        let o = open(c.0);
        if o < best_open {
            (best, best_open) = (c, o);
        }
        if found >= wanted {
            break;
        }
    }
    Ok(best)
}

/// Adds `delta` to a backend's shared open-flow count.
#[inline(always)]
fn count_active(backend_id: u32, delta: i64) {
    use core::intrinsics::{atomic_xadd, AtomicOrdering};
    if let Some(c) = BACKEND_ACTIVE.get_ptr_mut(backend_id) {
        // SAFETY: a valid, aligned map value; every CPU adds atomically (the
        // BPF target has no `AtomicI64::fetch_add`; this is BPF_ATOMIC_ADD).
        unsafe { atomic_xadd::<i64, i64, { AtomicOrdering::Relaxed }>(c, delta) };
    }
}

/// Whether to drop a mid-connection packet of a flow this node does not
/// know: from its first such packet until `HOLD_UNKNOWN_NS` after it. The
/// entry goes once the flow is known (picked afresh here, or imported by
/// the agent), so an entry that is there is this episode's, however far
/// apart the client's retransmissions come.
#[inline(always)]
fn hold_unknown(key: &FlowKey, t: u64) -> bool {
    match HELD_FLOWS.get_ptr(key) {
        // SAFETY: a map value, read once.
        Some(first) => t.saturating_sub(unsafe { *first }) < HOLD_UNKNOWN_NS,
        None => {
            // A full table evicts its oldest: that flow is then held afresh.
            let _ = HELD_FLOWS.insert(key, &t, 0);
            true
        }
    }
}

/// Marks a flow closed (once) at `t`: counted in `BACKEND_CLOSED` and, by
/// how long it was open, in `FLOW_TIMES`; taken off `BACKEND_ACTIVE` if it
/// was counted there.
#[inline(always)]
pub fn close_flow(flow: &mut Flow, t: u64) {
    if flow.flags & FLOW_F_CLOSED != 0 {
        return;
    }
    flow.flags |= FLOW_F_CLOSED;
    crate::stats::count_closed(flow.backend_id);
    crate::stats::count_flow_time(flow.backend_id, t.saturating_sub(flow.created_ns));
    if flow.flags & FLOW_F_COUNTED != 0 {
        count_active(flow.backend_id, -1);
    }
}

/// Points `s.target` at a remembered flow's backend.
#[inline(always)]
fn set_target(s: &mut Scratch, flow: &Flow, new_flow: u16) {
    copy_addr(&mut s.target.backend.addr, &flow.backend_addr);
    s.target.backend.port = flow.backend_port;
    s.target.backend.family = s.key.family;
    s.target.backend_id = flow.backend_id;
    copy_addr(&mut s.flow.snat_addr, &flow.snat_addr);
    s.target.snat_port = flow.snat_port;
    s.target.new_flow = new_flow;
}

/// Finds the flow's backend, creating the flow (and its reply entry, and in
/// SNAT mode its source port) on a miss. `closing`: a TCP FIN or RST;
/// `syn`: a TCP SYN without ACK, which starts a connection afresh even when
/// an old flow with the same tuple is still in the table (the new flow's
/// insert replaces it, for every CPU at once), except a handed flow's
/// (see [`HANDED_SYN_NS`]).
///
/// Not inlined (its own stack frame); fills `s.target` and returns
/// [`FOUND`], or returns the `Reason` to drop the packet for.
#[inline(never)]
pub fn lookup_or_create(
    svc: &ServiceInfo,
    closing: bool,
    syn: bool,
    t: u64,
    s: &mut Scratch,
) -> u32 {
    // In the scratch, not a register: a pointer that is null on some paths
    // and not on others would make the verifier walk `create` twice.
    s.target.replaces = 0;
    // In flood mode a SYN does not look for an entry to replace: the
    // lookup's cache misses were most of an untracked SYN's cost (docs/
    // datapath.md, "Flood mode"). A handed flow's SYN still looks.
    let look = !syn || svc.flags & SERVICE_F_HOLD_UNKNOWN != 0 || !crate::flood::engaged(t);
    if let Some(flow) = if look {
        FLOWS.get_ptr_mut(&s.key)
    } else {
        None
    } {
        s.target.replaces = 1;
        // SAFETY: shared entry; plain stores, a racing CPU writes similar values.
        let flow = unsafe { &mut *flow };
        let idle = t.saturating_sub(flow.last_seen_ns);
        let retransmitted_syn =
            flow.flags & (FLOW_F_HANDED | FLOW_F_CLOSED) == FLOW_F_HANDED && idle < HANDED_SYN_NS;
        if !syn || retransmitted_syn {
            // A flow of a service since replaced on the same VIP:port is not
            // this one's; an SNAT flow idle past its lifetime may have lost
            // its port to another flow; a closed one long quiet is a
            // previous connection's (CLOSED_STALE_NS).
            let snat = svc.flags & SERVICE_F_SNAT != 0;
            let stale = flow.flags & FLOW_F_CLOSED != 0
                && idle > CLOSED_STALE_NS
                && svc.flags & SERVICE_F_HOLD_UNKNOWN != 0;
            if flow.service_id == svc.id
                && !stale
                && !(snat && idle > lifetime_ns(&config(), s.key.proto, false))
            {
                set_target(s, flow, 0);
                if closing {
                    close_flow(flow, t);
                }
                if idle > REFRESH_NS || closing {
                    let cfg = config();
                    flow.last_seen_ns = t;
                    set_reply_key(
                        &mut s.reply_key,
                        &s.key,
                        svc,
                        &s.target.backend,
                        (&flow.snat_addr, flow.snat_port),
                    );
                    if !refresh_reply(&s.reply_key, &cfg, s.key.proto, closing, t)
                        && !snat
                        && !reversible(svc, &flow.backend_addr, flow.backend_port, s)
                    {
                        // NAT mode: the reply translation was evicted (the
                        // key is this flow's own) and no reverse translation
                        // stands in; put it back.
                        set_reply_value(
                            &mut s.reply,
                            &s.key,
                            svc.id,
                            flow.backend_id,
                            closing,
                            t + lifetime_ns(&cfg, s.key.proto, closing),
                        );
                        let _ = REPLY_NAT.insert(&s.reply_key, &s.reply, 0);
                    }
                }
                return FOUND;
            }
        }
    }
    if !syn && s.key.proto == PROTO_TCP {
        // Mid-connection and not in the table: evicted, older than this
        // node's view of it, or opened by another node whose flows have not
        // come yet (held a while). Maglev picks again.
        if svc.flags & SERVICE_F_HOLD_UNKNOWN != 0 {
            if hold_unknown(&s.key, t) {
                return Reason::DropHeldUnknownFlow as u32;
            }
            // Known from now on: a later loss is held afresh.
            let _ = HELD_FLOWS.remove(&s.key);
        }
        crate::stats::count_flow_event(FLOW_EVENT_REPICKED);
    }
    if svc.flags & SERVICE_F_FLOW_LIMIT != 0 && !crate::limit::admit(svc, s) {
        return Reason::DropFlowLimit as u32;
    }
    create(svc, closing, t, s)
}

#[inline(always)]
fn create(svc: &ServiceInfo, closing: bool, t: u64, s: &mut Scratch) -> u32 {
    let (backend_id, backend) = match pick_new(&s.key, svc) {
        Ok(p) => p,
        Err(r) => return r as u32,
    };
    let cfg = config();
    set_reply_value(
        &mut s.reply,
        &s.key,
        svc.id,
        backend_id,
        closing,
        t + lifetime_ns(&cfg, s.key.proto, closing),
    );
    let mut snat_port = 0u16;
    let mut new_flow = NEW_FLOW;
    if svc.flags & SERVICE_F_SNAT != 0 {
        snat_port = claim_snat_port(svc, backend, &cfg, s);
        if snat_port == 0 {
            return Reason::DropSnatExhausted as u32;
        }
    } else if reversible(svc, &backend.addr, backend.port, s) {
        // A closing flow is always written: its close is counted once. An
        // entry this flow does not take (a SYN reusing the tuple, another
        // service's) must be replaced, or the next packet would follow it.
        if svc.flags & STATEFUL == 0 && !closing && s.target.replaces == 0 {
            new_flow = NEW_FLOW_STATELESS;
        }
    } else {
        // NAT mode, a backend shared by services: the reply entry is made
        // now (its key holds the client tuple, so it is this flow's own).
        // Otherwise the first reply makes it from `BACKEND_REVERSE`.
        set_reply_key(&mut s.reply_key, &s.key, svc, backend, (&svc.snat_addr, 0));
        let _ = REPLY_NAT.insert(&s.reply_key, &s.reply, 0);
    }
    copy_addr(&mut s.flow.backend_addr, &backend.addr);
    s.flow.backend_port = backend.port;
    // Unused without an SNAT port (NAT mode).
    copy_addr(&mut s.flow.snat_addr, &svc.snat_addr);
    s.flow.snat_port = snat_port;
    s.flow.backend_id = backend_id;
    s.flow.service_id = svc.id;
    // A flow that begins with a FIN or RST is opened and closed at once.
    s.flow.flags = 0;
    if closing {
        s.flow.flags = FLOW_F_CLOSED;
        crate::stats::count_closed(backend_id);
    } else if svc.flags & SERVICE_F_LEAST_LOADED != 0 {
        s.flow.flags = FLOW_F_COUNTED;
        count_active(backend_id, 1);
    }
    s.flow.created_ns = t;
    s.flow.last_seen_ns = t;
    // The caller inserts `s.flow` into FLOWS once the packet has been
    // rewritten and routed.
    copy_addr(&mut s.target.backend.addr, &backend.addr);
    s.target.backend.port = backend.port;
    s.target.backend.family = backend.family;
    s.target.backend_id = backend_id;
    s.target.snat_port = snat_port;
    s.target.new_flow = new_flow;
    FOUND
}

/// Service flags whose flows keep state of their own in the flow table:
/// never left out of it in flood mode.
const STATEFUL: u32 = SERVICE_F_LEAST_LOADED | SERVICE_F_FLOW_LIMIT | SERVICE_F_HOLD_UNKNOWN;

/// Whether `BACKEND_REVERSE` translates this NAT flow's replies (its
/// backend belongs to this service only).
#[inline(always)]
fn reversible(svc: &ServiceInfo, addr: &[u32; 4], port: u16, s: &mut Scratch) -> bool {
    copy_addr(&mut s.reverse_key.addr, addr);
    s.reverse_key.port = port;
    s.reverse_key.proto = s.key.proto;
    s.reverse_key.family = s.key.family;
    match BACKEND_REVERSE.get_ptr(&s.reverse_key) {
        // SAFETY: read of a map value.
        Some(r) => unsafe { (*r).service_id == svc.id && (*r).vport == s.key.dport },
        None => false,
    }
}

/// Pushes a reply entry's expiry forward; once closing, it stays closing.
#[inline(always)]
fn refresh(r: &mut ReplyNat, cfg: &Config, proto: u8, closing: bool, t: u64) {
    let closing = closing || r.flags & REPLY_F_CLOSING != 0;
    let expires = t + lifetime_ns(cfg, proto, closing);
    if closing {
        r.flags |= REPLY_F_CLOSING;
        if expires < r.expires_ns {
            r.expires_ns = expires;
        }
    } else if expires > r.expires_ns + REFRESH_NS {
        r.expires_ns = expires;
    }
}

/// Refreshes the reply entry under `rk`; false if there is none.
#[inline(always)]
fn refresh_reply(rk: &FlowKey, cfg: &Config, proto: u8, closing: bool, t: u64) -> bool {
    match REPLY_NAT.get_ptr_mut(rk) {
        Some(r) => {
            // SAFETY: plain stores; a racing CPU writes similar values.
            refresh(unsafe { &mut *r }, cfg, proto, closing, t);
            true
        }
        None => false,
    }
}

/// The flow's hash the SNAT port candidates derive from. Not inlined: its
/// registers would spill into `lookup_or_create`'s frame, which the probe
/// callback's frame is stacked on (the verifier's 512-byte limit).
#[inline(never)]
fn set_probe_hash(s: &mut Scratch) {
    s.probe.h = flow_hash(&s.key);
}

/// Claims a source port for a new SNAT flow: probes deterministic candidates,
/// taking a free one, one left by this same client flow (seen by another
/// CPU), or one whose previous flow has expired. Returns the port (network
/// order), or 0 when every probe was taken. Expects `s.reply` filled.
///
/// The probes run under `bpf_loop`, so the verifier checks one probe once
/// rather than all of them on every path to a new SNAT flow: unrolled, the
/// probes were more than half of the instructions it walked (970 k of its
/// 1 M limit with 16 probes, 435 k with one).
#[inline(always)]
fn claim_snat_port(svc: &ServiceInfo, backend: &Backend, cfg: &Config, s: &mut Scratch) -> u16 {
    set_reply_key(&mut s.reply_key, &s.key, svc, backend, (&svc.snat_addr, 0));
    set_probe_hash(s);
    s.probe.service_id = svc.id;
    s.probe.min = cfg.snat_port_min;
    s.probe.max = cfg.snat_port_max;
    s.probe.port = 0;
    // The scratch goes to the callback through the context, so that the
    // compiler knows the call reads and writes it (through `&mut` alone it
    // may assume the helper touches neither, and keep stale values).
    let mut scratch: *mut Scratch = s;
    // SAFETY: a helper call; `snat_probe` gets a pointer to `scratch`,
    // which outlives the call.
    unsafe {
        bpf_loop(
            SNAT_PROBES,
            snat_probe as *mut c_void,
            &mut scratch as *mut *mut Scratch as *mut c_void,
            0,
        )
    };
    s.probe.port
}

/// Probe number `probe`: 1 (stop) once the port is claimed.
#[inline(never)]
unsafe extern "C" fn snat_probe(probe: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `claim_snat_port` passes a pointer to its pointer to this
    // CPU's scratch value, which it filled.
    let s = unsafe { &mut **(ctx as *mut *mut Scratch) };
    let c = s.probe;
    let port = snat_port_candidate(c.h, probe as u32, c.min, c.max).to_be();
    s.reply_key.dport = port;
    if REPLY_NAT
        .insert(&s.reply_key, &s.reply, BPF_NOEXIST as u64)
        .is_ok()
    {
        s.probe.port = port;
        return 1;
    }
    if let Some(r) = REPLY_NAT.get_ptr_mut(&s.reply_key) {
        // SAFETY: shared entry; we only take it when it is ours or expired.
        let r = unsafe { &mut *r };
        if same_client(r, &s.key) || r.expires_ns < now() {
            let closing = s.reply.flags & REPLY_F_CLOSING != 0;
            set_reply_value(
                r,
                &s.key,
                c.service_id,
                s.reply.backend_id,
                closing,
                s.reply.expires_ns,
            );
            s.probe.port = port;
            return 1;
        }
    }
    0
}

/// Read-only lookup of an existing flow (for ICMP errors): the flow table,
/// else Maglev plus, in SNAT mode, the reply table entry that proves the
/// flow and gives its port. Reads `s.key`, fills `s.target`.
#[inline(always)]
pub fn find(svc: &ServiceInfo, s: &mut Scratch) -> Option<()> {
    if let Some(f) = FLOWS.get_ptr(&s.key) {
        // SAFETY: read of a shared entry.
        let f = unsafe { &*f };
        if f.service_id == svc.id {
            set_target(s, f, 0);
            return Some(());
        }
    }
    let (backend_id, backend) = pick(&s.key, svc).ok()?;
    copy_addr(&mut s.target.backend.addr, &backend.addr);
    s.target.backend.port = backend.port;
    s.target.backend.family = backend.family;
    s.target.backend_id = backend_id;
    copy_addr(&mut s.flow.snat_addr, &svc.snat_addr);
    s.target.snat_port = 0;
    s.target.new_flow = 0;
    if svc.flags & SERVICE_F_SNAT == 0 {
        return Some(());
    }
    let cfg = config();
    set_probe_hash(s);
    let h = s.probe.h;
    // Unrolled, unlike `claim_snat_port`'s probes: under `bpf_loop` the ICMP
    // path's call chain needs more stack than the verifier allows (544 of
    // 512 bytes).
    for probe in 0..SNAT_PROBES {
        let port = snat_port_candidate(h, probe, cfg.snat_port_min, cfg.snat_port_max).to_be();
        set_reply_key(
            &mut s.reply_key,
            &s.key,
            svc,
            backend,
            (&svc.snat_addr, port),
        );
        if let Some(r) = REPLY_NAT.get_ptr(&s.reply_key) {
            // SAFETY: read of a shared entry.
            if same_client(unsafe { &*r }, &s.key) {
                s.target.snat_port = port;
                return Some(());
            }
        }
    }
    None
}

/// Reply translation for a packet from a backend, if it belongs to a flow.
/// Refreshes the entry's lifetime when it is due (or on FIN/RST).
#[inline(always)]
// The reference is to the map's value, valid for this program run, not to `key`.
#[allow(clippy::mut_from_ref)]
pub fn reply_lookup(key: &FlowKey, closing: bool, t: u64) -> Option<&mut ReplyNat> {
    let r = REPLY_NAT.get_ptr_mut(key)?;
    // SAFETY: shared entry; plain stores, a racing CPU writes similar values.
    let r = unsafe { &mut *r };
    refresh(r, &config(), key.proto, closing, t);
    Some(r)
}

/// A reply with no `REPLY_NAT` entry from a backend that belongs to one
/// NAT-mode service: makes its entry from `BACKEND_REVERSE`, whether or
/// not this node forwarded the flow (another node of an ECMP group may have,
/// or this node before a restart). A reply to this node's own address (a
/// health check) is not a service's. Reads `s.key`; not inlined: a flow's
/// first reply only.
#[inline(never)]
// The reference is to the map's value, valid for this program run.
#[allow(clippy::mut_from_ref)]
pub fn reply_from_reverse(
    ctx: &XdpContext,
    h: &Headers,
    s: &mut Scratch,
    closing: bool,
) -> Option<&'static mut ReplyNat> {
    copy_addr(&mut s.reverse_key.addr, &s.key.src);
    s.reverse_key.port = s.key.sport;
    s.reverse_key.proto = s.key.proto;
    s.reverse_key.family = s.key.family;
    let rev = BACKEND_REVERSE.get_ptr(&s.reverse_key)?;
    // SAFETY: read of a map value; the entry stays valid for this run.
    let rev = unsafe { &*rev };
    if crate::forward::is_local(ctx, h, &rev.vip, &s.key.dst) {
        return None;
    }
    if crate::mac::pod_side(ctx) && !crate::forward::leaves_by_uplink(ctx, h, &rev.vip, &s.key.dst)
    {
        return None;
    }
    let cfg = config();
    copy_addr(&mut s.reply.vip, &rev.vip);
    copy_addr(&mut s.reply.client, &s.key.dst);
    s.reply.vport = rev.vport;
    s.reply.cport = s.key.dport;
    s.reply.service_id = rev.service_id;
    s.reply.backend_id = rev.backend_id;
    s.reply.flags = if closing { REPLY_F_CLOSING } else { 0 };
    s.reply.expires_ns = now() + lifetime_ns(&cfg, s.key.proto, closing);
    s.reply.fib.ifindex = 0;
    REPLY_NAT.insert(&s.key, &s.reply, 0).ok()?;
    let r = REPLY_NAT.get_ptr_mut(&s.key)?;
    // SAFETY: shared entry, valid for this program run.
    Some(unsafe { &mut *r })
}

/// A backend's RST ends its flow: the client may never send again (no FIN
/// or RST of its own), so the flow is counted closed here. Uses `key` as
/// scratch for the client-side key. Not inlined: only resets pay for it.
#[inline(never)]
pub fn close_from_backend(r: &ReplyNat, key: &mut FlowKey, proto: u8, family: u8) {
    copy_addr(&mut key.src, &r.client);
    copy_addr(&mut key.dst, &r.vip);
    key.sport = r.cport;
    key.dport = r.vport;
    key.proto = proto;
    key.family = family;
    key._pad = [0; 2];
    if let Some(f) = FLOWS.get_ptr_mut(key) {
        // SAFETY: shared entry; a racing CPU sets the same bit.
        let f = unsafe { &mut *f };
        if f.backend_id == r.backend_id {
            close_flow(f, crate::clock::now());
        }
    }
}
