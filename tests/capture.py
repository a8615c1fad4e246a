"""A packet capture on this machine's interfaces (AF_PACKET, root), as tcpdump would take it
between two hosts: the TCP payloads between the given addresses, put back in order per
connection and direction, to be searched for what must never cross the wire in the clear."""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
import threading
from collections import defaultdict

ETH_P_ALL, ETH_P_IP = 0x0003, 0x0800
SO_RCVBUFFORCE, SOL_PACKET, PACKET_STATISTICS, SO_ATTACH_FILTER = 33, 263, 6, 26
PACKET_IGNORE_OUTGOING = 23  # Linux 4.20+


class Capture:
    def __init__(self, hosts: set[str] | None = None, net: str | None = None, exclude: set[str] = frozenset()):
        """Keeps TCP between two addresses of `net` (or of `hosts`), neither in `exclude`."""
        self.net = ipaddress.ip_network(net, strict=False) if net else None
        self.hosts, self.exclude = hosts, exclude
        self.segments: dict[tuple, dict[int, bytes]] = defaultdict(dict)
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 << 20)
        # A packet between two instances enters this namespace on the sender's veth and leaves
        # on the receiver's: the entering copy is enough. With both, a busy run (the rest of
        # the suite beside it on two cores) overran the buffer and dropped 35,153 frames.
        self.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        if self.net is not None and self.net.version == 4:
            _only_tcp_within(self.sock, self.net)
        self.sock.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _wanted(self, ip: str) -> bool:
        if ip in self.exclude:
            return False
        return ip in self.hosts if self.hosts is not None else ipaddress.ip_address(ip) in self.net

    def _run(self) -> None:
        buffer = bytearray(262144)  # one buffer for every frame: recv() made a 256 KB object each
        while not self.stopped.is_set():
            try:
                size = self.sock.recv_into(buffer)
            except socket.timeout:
                continue
            frame = memoryview(buffer)[:size]
            if len(frame) < 34 or struct.unpack("!H", frame[12:14])[0] != ETH_P_IP:
                continue
            ip = frame[14:]
            ihl, proto = (ip[0] & 0x0F) * 4, ip[9]
            if proto != 6:
                continue
            src, dst = socket.inet_ntoa(bytes(ip[12:16])), socket.inet_ntoa(bytes(ip[16:20]))
            if not (self._wanted(src) and self._wanted(dst)):
                continue
            total = struct.unpack("!H", ip[2:4])[0]
            tcp = ip[ihl:total]
            sport, dport, seq = struct.unpack("!HHI", tcp[:8])
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload:  # a retransmission shows twice: keyed by seq, kept once
                self.segments[(src, sport, dst, dport)].setdefault(seq, bytes(payload))

    def stop(self) -> dict[tuple, bytes]:
        """The byte streams: {(src, sport, dst, dport): payload in sequence order}. `dropped`
        then says how many packets the kernel could not hand over (statistics since the last read)."""
        self.stopped.set()
        self.thread.join()
        _, self.dropped = struct.unpack("II", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
        self.sock.close()
        streams = {}
        for flow, segments in self.segments.items():
            first = min(segments)  # sequence numbers wrap rarely within a test's connection
            streams[flow] = b"".join(segments[s] for s in sorted(segments, key=lambda s: (s - first) % 2 ** 32))
        return streams


def _only_tcp_within(sock: socket.socket, net: ipaddress.IPv4Network) -> None:
    """A classic BPF program on the socket (the kernel copies it): only IPv4 TCP frames whose
    both ends are in `net` are queued. Without it every frame of the machine, the other test
    session's loopback traffic included, had to pass through this Python thread."""
    net_k, mask = int(net.network_address), int(net.netmask)
    program = [  # (code, jump if true, jump if false, k); jumps count from the next instruction
        (0x28, 0, 0, 12),  # A = ethertype (ldh [12])
        (0x15, 0, 9, ETH_P_IP),  # not IPv4: drop
        (0x30, 0, 0, 23),  # A = IP protocol (ldb [23])
        (0x15, 0, 7, 6),  # not TCP: drop
        (0x20, 0, 0, 26),  # A = source address (ld [26])
        (0x54, 0, 0, mask),
        (0x15, 0, 4, net_k),  # source outside net: drop
        (0x20, 0, 0, 30),  # A = destination address (ld [30])
        (0x54, 0, 0, mask),
        (0x15, 0, 1, net_k),  # destination outside net: drop
        (0x06, 0, 0, 262144),  # keep the frame whole
        (0x06, 0, 0, 0),  # drop
    ]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in program))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", len(program), ctypes.addressof(code)))


def found(streams: dict[tuple, bytes], needles: dict[str, list[bytes]]) -> dict[str, list[str]]:
    """Which needles of each kind occur in any stream, with the connection they crossed."""
    hits: dict[str, list[str]] = {}
    for kind, values in needles.items():
        for value in values:
            for (src, sport, dst, dport), data in streams.items():
                if value in data:
                    hits.setdefault(kind, []).append(f"{value[:40]!r} {src}:{sport} -> {dst}:{dport}")
                    break
    return hits
