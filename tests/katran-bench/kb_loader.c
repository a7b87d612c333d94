// SPDX-License-Identifier: GPL-2.0
/*
 * kb_loader.c: loads Katran's balancer object and kb_wrap.bpf.o with libbpf
 * and fills Katran's maps the way katran_tester does (KatranLb with no
 * forwarding cores: no per-CPU LRUs, so the program uses `fallback_cache`),
 * or, with kb_katran_attach_lrus, as KatranLb does with forwarding cores.
 * Linked into kbench (kbench.rs); every function returns 0 or -errno.
 *
 * The Katran structs below are written from the layouts in
 * katran/lib/bpf/balancer_structs.h; each map's key/value size is checked
 * against the object's BTF before use.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#define K_RING_SIZE 65537u /* RING_SIZE, default build */
#define K_MAX_VIPS 512u    /* MAX_VIPS */

struct k_vip_definition {
	union {
		uint32_t vip;
		uint32_t vipv6[4];
	};
	uint16_t port;
	uint8_t proto;
};

struct k_vip_meta {
	uint32_t flags;
	uint32_t vip_num;
};

struct k_real_definition {
	union {
		uint32_t dst;
		uint32_t dstv6[4];
	};
	uint8_t flags;
};

struct k_ctl_value {
	union {
		uint64_t value;
		uint32_t ifindex;
		uint8_t mac[6];
	};
};

struct k_lb_stats {
	uint64_t v1;
	uint64_t v2;
};

struct kb_katran {
	int prog_fd;
	int stats_fd;
	int ncpus;
	int pad;
	struct bpf_object *obj;
};

struct kb_wrap {
	int wrap_fd;
	int pass_fd;
	int jmp_fd;
	int orig_fd;
	struct bpf_object *obj;
};

#define KB_MAXPKT 256
#define KB_HDR 64
struct kb_orig {
	uint32_t len;
	uint32_t vary;
	uint32_t src;
	uint32_t port;
	uint64_t counter;
	uint8_t data[KB_MAXPKT];
};

/* Opens and loads the BPF object at `path`. */
static int open_and_load(const char *path, struct bpf_object **obj)
{
	*obj = bpf_object__open_file(path, NULL);
	if (!*obj) {
		int err = -errno;
		fprintf(stderr, "kb_loader: open %s: %s\n", path, strerror(-err));
		return err;
	}
	int err = bpf_object__load(*obj);
	if (err)
		fprintf(stderr, "kb_loader: load %s: %s\n", path, strerror(-err));
	return err;
}

static int map_fd_checked(struct bpf_object *obj, const char *name,
			  uint32_t key_size, uint32_t value_size)
{
	struct bpf_map *m = bpf_object__find_map_by_name(obj, name);
	if (!m) {
		fprintf(stderr, "kb_loader: no map %s\n", name);
		return -ENOENT;
	}
	if (bpf_map__key_size(m) != key_size ||
	    bpf_map__value_size(m) != value_size) {
		fprintf(stderr,
			"kb_loader: map %s has key/value %u/%u bytes, expected %u/%u\n",
			name, bpf_map__key_size(m), bpf_map__value_size(m),
			key_size, value_size);
		return -EINVAL;
	}
	return bpf_map__fd(m);
}

static int upd(int fd, const void *k, const void *v, const char *what)
{
	if (bpf_map_update_elem(fd, k, v, BPF_ANY)) {
		int e = errno;
		fprintf(stderr, "kb_loader: update %s: %s\n", what, strerror(e));
		return -e;
	}
	return 0;
}

/*
 * Loads Katran's balancer object and configures:
 *   vip_map  vip:tcp_port/TCP -> vip_num 0, vip:udp_port/UDP -> vip_num 1,
 *            flags 0 (as KatranLb::addVip);
 *   reals    indexes 1..nreals -> real_base + i - 1 (IPv4; index 0 unused,
 *            as in KatranLb);
 *   ch_rings both VIPs' rings (RING_SIZE entries each) filled with real
 *            indexes 1..nreals in turn (every ring slot points at a real);
 *   ctl_array[0] = mac (katran_tester's kDefaultMac).
 * Addresses and ports are in network byte order, real_base in host order.
 */
int kb_katran_load(const char *path, uint32_t vip, uint16_t tcp_port,
		   uint16_t udp_port, uint32_t real_base, uint32_t nreals,
		   const uint8_t *mac, struct kb_katran *out)
{
	int err;
	memset(out, 0, sizeof(*out));
	struct bpf_object *obj;
	if ((err = open_and_load(path, &obj)))
		return err;
	struct bpf_program *p = bpf_object__find_program_by_name(obj, "balancer_ingress");
	if (!p) {
		fprintf(stderr, "kb_loader: no program balancer_ingress in %s\n", path);
		return -ENOENT;
	}
	out->obj = obj;
	out->prog_fd = bpf_program__fd(p);
	out->ncpus = libbpf_num_possible_cpus();

	int vip_map = map_fd_checked(obj, "vip_map", sizeof(struct k_vip_definition),
				     sizeof(struct k_vip_meta));
	int reals = map_fd_checked(obj, "reals", 4, sizeof(struct k_real_definition));
	int rings = map_fd_checked(obj, "ch_rings", 4, 4);
	int ctl = map_fd_checked(obj, "ctl_array", 4, sizeof(struct k_ctl_value));
	int stats = map_fd_checked(obj, "stats", 4, sizeof(struct k_lb_stats));
	if (vip_map < 0 || reals < 0 || rings < 0 || ctl < 0 || stats < 0)
		return -EINVAL;
	out->stats_fd = stats;

	for (uint32_t num = 0; num < 2; num++) {
		struct k_vip_definition k;
		struct k_vip_meta m = {.flags = 0, .vip_num = num};
		memset(&k, 0, sizeof(k));
		k.vip = vip;
		k.port = num == 0 ? tcp_port : udp_port;
		k.proto = num == 0 ? IPPROTO_TCP : IPPROTO_UDP;
		if ((err = upd(vip_map, &k, &m, "vip_map")))
			return err;
	}
	for (uint32_t i = 1; i <= nreals; i++) {
		struct k_real_definition r;
		memset(&r, 0, sizeof(r));
		r.dst = htonl(real_base + i - 1);
		if ((err = upd(reals, &i, &r, "reals")))
			return err;
	}
	for (uint32_t num = 0; num < 2; num++) {
		for (uint32_t i = 0; i < K_RING_SIZE; i++) {
			uint32_t key = num * K_RING_SIZE + i;
			uint32_t real = 1 + i % nreals;
			if ((err = upd(rings, &key, &real, "ch_rings")))
				return err;
		}
	}
	struct k_ctl_value c;
	memset(&c, 0, sizeof(c));
	memcpy(c.mac, mac, 6);
	uint32_t zero = 0;
	if ((err = upd(ctl, &zero, &c, "ctl_array")))
		return err;
	return 0;
}

/*
 * Katran as deployed (KatranLb with forwarding cores): one LRU_HASH of
 * `entries` flows per CPU, put into lru_mapping[cpu], so the program uses
 * it instead of the 1,000-entry fallback_cache. Flags 0, as KatranLb
 * creates them without NUMA nodes; key and value sizes from fallback_cache,
 * which has the same inner layout.
 */
int kb_katran_attach_lrus(const struct kb_katran *k, uint32_t entries)
{
	int mapping = map_fd_checked(k->obj, "lru_mapping", 4, 4);
	struct bpf_map *fb = bpf_object__find_map_by_name(k->obj, "fallback_cache");
	if (mapping < 0 || !fb) {
		fprintf(stderr, "kb_loader: no lru_mapping or fallback_cache\n");
		return -ENOENT;
	}
	for (int cpu = 0; cpu < k->ncpus; cpu++) {
		int fd = bpf_map_create(BPF_MAP_TYPE_LRU_HASH, "katran_lru",
					bpf_map__key_size(fb), bpf_map__value_size(fb),
					entries, NULL);
		if (fd < 0) {
			int err = -errno;
			fprintf(stderr, "kb_loader: LRU of %u for CPU %d: %s\n", entries,
				cpu, strerror(-err));
			return err;
		}
		uint32_t key = cpu;
		int err = upd(mapping, &key, &fd, "lru_mapping");
		if (err)
			return err;
	}
	return 0;
}

/* Sum over CPUs of stats[idx] (a PERCPU_ARRAY of struct lb_stats). */
int kb_katran_stat(const struct kb_katran *k, uint32_t idx, uint64_t *v1, uint64_t *v2)
{
	struct k_lb_stats *vals = calloc(k->ncpus, sizeof(*vals));
	if (!vals)
		return -ENOMEM;
	if (bpf_map_lookup_elem(k->stats_fd, &idx, vals)) {
		int e = errno;
		free(vals);
		return -e;
	}
	*v1 = 0;
	*v2 = 0;
	for (int i = 0; i < k->ncpus; i++) {
		*v1 += vals[i].v1;
		*v2 += vals[i].v2;
	}
	free(vals);
	return 0;
}

/* stats[idx] on one CPU. */
int kb_katran_stat_cpu(const struct kb_katran *k, uint32_t idx, int cpu,
		       uint64_t *v1, uint64_t *v2)
{
	struct k_lb_stats *vals = calloc(k->ncpus, sizeof(*vals));
	if (!vals)
		return -ENOMEM;
	if (cpu < 0 || cpu >= k->ncpus ||
	    bpf_map_lookup_elem(k->stats_fd, &idx, vals)) {
		int e = cpu < 0 || cpu >= k->ncpus ? EINVAL : errno;
		free(vals);
		return -e;
	}
	*v1 = vals[cpu].v1;
	*v2 = vals[cpu].v2;
	free(vals);
	return 0;
}

int kb_wrap_load(const char *path, struct kb_wrap *out)
{
	int err;
	memset(out, 0, sizeof(*out));
	struct bpf_object *obj;
	if ((err = open_and_load(path, &obj)))
		return err;
	struct bpf_program *w = bpf_object__find_program_by_name(obj, "kb_wrap");
	struct bpf_program *p = bpf_object__find_program_by_name(obj, "kb_pass");
	if (!w || !p)
		return -ENOENT;
	out->obj = obj;
	out->wrap_fd = bpf_program__fd(w);
	out->pass_fd = bpf_program__fd(p);
	out->jmp_fd = map_fd_checked(obj, "kb_jmp", 4, 4);
	out->orig_fd = map_fd_checked(obj, "kb_orig", 4, sizeof(struct kb_orig));
	if (out->jmp_fd < 0 || out->orig_fd < 0)
		return -EINVAL;
	struct kb_orig o;
	memset(&o, 0, sizeof(o));
	uint32_t zero = 0;
	return upd(out->orig_fd, &zero, &o, "kb_orig");
}

/*
 * Points the wrapper at target_fd with `pkt` as the original packet. With
 * `vary`, new flows start at source vary_base (host order), port 1024, the
 * first time; after that the wrapper's own position is kept, so flows are
 * never reused across calls.
 */
int kb_wrap_set(const struct kb_wrap *w, int target_fd, const uint8_t *pkt,
		uint32_t len, uint32_t vary, uint32_t vary_base)
{
	int err;
	if (len > KB_MAXPKT || len < KB_HDR)
		return -EINVAL;
	uint32_t zero = 0;
	struct kb_orig o;
	if (bpf_map_lookup_elem(w->orig_fd, &zero, &o))
		return -errno;
	o.len = len;
	o.vary = vary;
	if (vary && o.counter == 0 && o.src == 0)
		o.src = vary_base;
	memset(o.data, 0, sizeof(o.data));
	memcpy(o.data, pkt, len);
	if ((err = upd(w->orig_fd, &zero, &o, "kb_orig")))
		return err;
	return upd(w->jmp_fd, &zero, &target_fd, "kb_jmp (is the target tail-callable?)");
}

uint64_t kb_wrap_counter(const struct kb_wrap *w)
{
	uint32_t zero = 0;
	struct kb_orig o;
	if (bpf_map_lookup_elem(w->orig_fd, &zero, &o))
		return 0;
	return o.counter;
}

/* Sizes of a loaded program: translated (BPF) and JIT-compiled bytes. */
int kb_prog_sizes(int fd, uint32_t *xlated, uint32_t *jited)
{
	struct bpf_prog_info info;
	uint32_t len = sizeof(info);
	memset(&info, 0, sizeof(info));
	if (bpf_obj_get_info_by_fd(fd, &info, &len))
		return -errno;
	*xlated = info.xlated_prog_len;
	*jited = info.jited_prog_len;
	return 0;
}
