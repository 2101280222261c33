//! Messages ([`crate::transport::Transport::exchange`]) through the per-pair byte rings of the
//! segment: headers checked against this rank's fingerprint, payloads streamed in pieces, all
//! sends and receives of one exchange progressing together (see the parent module's
//! "Messages" section).

use super::config::PIECE;
use super::wait::Idle;
use super::ShmTransport;
use crate::transport::{decode_header, encode_header, RecvFrom, SendTo, HEADER_LEN};
use crate::{Error, Result};
use std::sync::atomic::Ordering;

/// Message header bytes (same fields as the TCP frame header).
pub(super) const MSG_MAGIC: u32 = 0xDD9C_5E01;

/// Progress of one send within an exchange.
struct RingSend {
    header: [u8; HEADER_LEN],
    header_done: bool,
    done: usize,
}

/// Progress of one receive within an exchange.
struct RingRecv {
    header_done: bool,
    done: usize,
}

impl ShmTransport {
    pub(super) fn check_peer_index(&self, peer: usize, what: &str) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "{what} rank {peer}: not another rank of this group of size {} (this is rank {})",
                self.size, self.rank
            )));
        }
        Ok(())
    }

    pub(super) fn exchange_rings(
        &mut self,
        sends: &mut [SendTo<'_>],
        recvs: &mut [RecvFrom<'_>],
    ) -> Result<()> {
        for s in sends.iter() {
            self.check_peer_index(s.to, "send to")?;
        }
        for r in recvs.iter() {
            self.check_peer_index(r.from, "receive from")?;
        }
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let mut sst: Vec<RingSend> = sends
            .iter()
            .map(|s| RingSend {
                header: encode_header(MSG_MAGIC, 0, &self.fp, s.data.len() as u64),
                header_done: false,
                done: 0,
            })
            .collect();
        let mut rst: Vec<RingRecv> = recvs
            .iter()
            .map(|_| RingRecv {
                header_done: false,
                done: 0,
            })
            .collect();
        let mut st = Idle::default();
        let mut busy = vec![false; self.size];
        let seg = self.seg.as_ref().expect("a group with peers has a segment");
        loop {
            let seen = seg.bell(self.rank).load(Ordering::SeqCst);
            let mut progress = false;
            let mut pending = false;
            // Several messages to (from) one peer in one exchange go in posting order.
            busy.fill(false);
            for (s, ss) in sends.iter().zip(sst.iter_mut()) {
                if ss.header_done && ss.done == s.data.len() {
                    continue;
                }
                if std::mem::replace(&mut busy[s.to], true) {
                    pending = true;
                    continue;
                }
                let ring = seg.ring(self.rank, s.to);
                let mut tail = self.tails[s.to];
                let free = ring.cap - (tail - ring.head.load(Ordering::Acquire)) as usize;
                let mut room = free;
                if !ss.header_done && room >= HEADER_LEN {
                    ring.write_at(tail, &ss.header);
                    tail += HEADER_LEN as u64;
                    room -= HEADER_LEN;
                    ss.header_done = true;
                }
                if ss.header_done {
                    let n = room.min(s.data.len() - ss.done).min(PIECE);
                    ring.write_at(tail, &s.data[ss.done..ss.done + n]);
                    tail += n as u64;
                    ss.done += n;
                }
                if tail != self.tails[s.to] {
                    self.tails[s.to] = tail;
                    ring.tail.store(tail, Ordering::Release);
                    Self::ring_bell(seg, s.to);
                    progress = true;
                }
                if !(ss.header_done && ss.done == s.data.len()) {
                    pending = true;
                }
            }
            busy.fill(false);
            for (r, rs) in recvs.iter_mut().zip(rst.iter_mut()) {
                if rs.header_done && rs.done == r.buf.len() {
                    continue;
                }
                if std::mem::replace(&mut busy[r.from], true) {
                    pending = true;
                    continue;
                }
                let ring = seg.ring(r.from, self.rank);
                let mut head = self.heads[r.from];
                let mut avail = (ring.tail.load(Ordering::Acquire) - head) as usize;
                if !rs.header_done && avail >= HEADER_LEN {
                    let mut h = [0u8; HEADER_LEN];
                    ring.read_at(head, &mut h);
                    head += HEADER_LEN as u64;
                    avail -= HEADER_LEN;
                    rs.header_done = true;
                    let fail = match decode_header(MSG_MAGIC, &h).map(|h| (h.fp, h.len)) {
                        None => Some(
                            self.fail(r.from, "sent a corrupt message header (protocol violation)"),
                        ),
                        Some((None, _)) => {
                            Some(self.fail(r.from, "sent a message with an unknown operation code"))
                        }
                        Some((Some(remote), len))
                            if remote != self.fp || len != r.buf.len() as u64 =>
                        {
                            Some(Error::Mismatch {
                                rank: self.rank,
                                local: self.fp,
                                local_bytes: Some(r.buf.len() as u64),
                                peer: r.from,
                                remote: Some(remote),
                                remote_bytes: Some(len),
                            })
                        }
                        Some(_) => None,
                    };
                    if let Some(e) = fail {
                        self.heads[r.from] = head;
                        ring.head.store(head, Ordering::Release);
                        return Err(e);
                    }
                }
                if rs.header_done {
                    let n = avail.min(r.buf.len() - rs.done).min(PIECE);
                    ring.read_at(head, &mut r.buf[rs.done..rs.done + n]);
                    head += n as u64;
                    rs.done += n;
                }
                if head != self.heads[r.from] {
                    self.heads[r.from] = head;
                    ring.head.store(head, Ordering::Release);
                    Self::ring_bell(seg, r.from);
                    progress = true;
                }
                if !(rs.header_done && rs.done == r.buf.len()) {
                    pending = true;
                }
            }
            if !pending {
                self.record_entry_wait(&st);
                return Ok(());
            }
            if progress {
                if st.since.is_some() {
                    self.record_entry_wait(&st);
                }
                st = Idle::default();
                continue;
            }
            let waiting = || -> Vec<usize> {
                let mut w: Vec<usize> = recvs
                    .iter()
                    .zip(&rst)
                    .filter(|(r, rs)| !(rs.header_done && rs.done == r.buf.len()))
                    .map(|(r, _)| r.from)
                    .chain(
                        sends
                            .iter()
                            .zip(&sst)
                            .filter(|(s, ss)| !(ss.header_done && ss.done == s.data.len()))
                            .map(|(s, _)| s.to),
                    )
                    .collect();
                w.dedup();
                w
            };
            self.idle(&mut st, seen, &waiting, self.entry_pending.get())?;
        }
    }
}
