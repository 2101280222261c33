//! One-step algorithms: every transfer of the collective is posted in a single
//! [`Transport::exchange`], so the transport overlaps them. Gather, scatter and all-to-all move
//! distinct data to or from each peer, so nothing smarter saves bandwidth on a flat network.

use super::{bytes, bytes_mut};
use crate::dtype::Element;
use crate::transport::{RecvFrom, SendTo, Transport};
use crate::Result;

/// Gather every rank's `input` into `output` (length `input.len() * p`) on `root`, in rank order.
pub fn gather<T: Element>(
    t: &mut dyn Transport,
    input: &[T],
    output: Option<&mut [T]>,
    root: usize,
) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    match output {
        Some(out) if r == root => {
            let n = input.len();
            let mut recvs: Vec<RecvFrom<'_>> = Vec::with_capacity(p - 1);
            let mut rest = &mut out[..n * p];
            for i in 0..p {
                let (block, tail) = rest.split_at_mut(n);
                rest = tail;
                if i == r {
                    block.copy_from_slice(input);
                } else {
                    recvs.push(RecvFrom {
                        from: i,
                        buf: bytes_mut(block),
                    });
                }
            }
            t.exchange(&mut [], &mut recvs)
        }
        _ => t.send(root, bytes(input)),
    }
}

/// Scatter `input` (length `output.len() * p`, only read on `root`) so rank `i` gets block `i`.
pub fn scatter<T: Element>(
    t: &mut dyn Transport,
    input: Option<&[T]>,
    output: &mut [T],
    root: usize,
) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    match input {
        Some(inp) if r == root => {
            let n = output.len();
            let mut sends: Vec<SendTo<'_>> = (0..p)
                .filter(|&i| i != r)
                .map(|i| SendTo {
                    to: i,
                    data: bytes(&inp[i * n..(i + 1) * n]),
                })
                .collect();
            output.copy_from_slice(&inp[r * n..(r + 1) * n]);
            t.exchange(&mut sends, &mut [])
        }
        _ => t.recv(root, bytes_mut(output)),
    }
}

/// All-to-all with equal blocks: block `j` of `input` goes to rank `j`; block `i` of `output`
/// comes from rank `i`. Both have length `n * p`.
pub fn all_to_all<T: Element>(t: &mut dyn Transport, input: &[T], output: &mut [T]) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    let n = input.len() / p;
    let mut sends: Vec<SendTo<'_>> = (0..p)
        .filter(|&j| j != r)
        .map(|j| SendTo {
            to: j,
            data: bytes(&input[j * n..(j + 1) * n]),
        })
        .collect();
    let mut recvs: Vec<RecvFrom<'_>> = Vec::with_capacity(p - 1);
    let mut rest = output;
    for i in 0..p {
        let (block, tail) = rest.split_at_mut(n);
        rest = tail;
        if i == r {
            block.copy_from_slice(&input[r * n..(r + 1) * n]);
        } else {
            recvs.push(RecvFrom {
                from: i,
                buf: bytes_mut(block),
            });
        }
    }
    t.exchange(&mut sends, &mut recvs)
}
