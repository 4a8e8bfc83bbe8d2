//! The automaton behind [`Masker`](super::Masker): every occurrence of every value, and where a
//! value may be starting at a piece's end, each in one pass over the bytes whatever the values.
//!
//! An Aho-Corasick automaton (a contiguous NFA, see [`super::automaton`] for why) stands, after
//! reading some bytes, in the state of the longest suffix of them that begins a value. Its own
//! matches are not used: with overlapping (standard) semantics each state keeps a list of every
//! value that ends in it or in a suffix of it, quadratic in size (the lines `aaaa`, `aaaaa`, … of
//! one 3 MB Secret overflowed its 2^31 states). Each value is given to it with a NUL byte after
//! it, a byte no value holds (env values cannot), so only those end states, one per value, hold
//! matches, and each only the values that end the same way: at most as many as it is long. Two tables
//! by state, made once at build in one walk over the values, answer the masker's two questions
//! from that state alone: the longest value ending there, and the longest suffix that is the start
//! of a *longer* value (the bytes to hold back). Asking the automaton for every overlapping match
//! instead, and comparing each candidate start with the values, cost time quadratic in the
//! values' length or count: a guest printing `a`s against values of `a`s (up to the env's 4 MiB)
//! held the agent's thread for minutes on each piece of output.

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::contiguous::NFA;
use aho_corasick::{Anchored, BuildError, MatchKind};

pub(super) struct ValueAutomaton {
    nfa: NFA,
    /// By state id: the length of the longest value that ends in this state (0: none).
    longest_value: Vec<u32>,
    /// By state id: the length of the longest suffix of what led here that a longer value starts
    /// with (0: none).
    open_start: Vec<u32>,
}

/// What follows each value in the automaton (see the module documentation). Were a value to hold
/// it, the tables would still be right; only the automaton's size bound would not hold.
const END: u8 = 0;

/// A state's table entry, the tables growing to the highest state id seen.
fn entry(table: &mut Vec<u32>, sid: StateID) -> &mut u32 {
    let i = sid.as_usize();
    if table.len() <= i {
        table.resize(i + 1, 0);
    }
    &mut table[i]
}

impl ValueAutomaton {
    /// The automaton of `values` (non-empty, none empty) and its two tables.
    pub(super) fn new(values: &[Vec<u8>]) -> Result<ValueAutomaton, BuildError> {
        let ended = values.iter().map(|v| [v.as_slice(), &[END]].concat());
        let nfa = NFA::builder().match_kind(MatchKind::Standard).build(ended)?;
        let mut built = ValueAutomaton {
            nfa,
            longest_value: vec![],
            open_start: vec![],
        };
        built.fill_tables(values);
        Ok(built)
    }

    /// Walks every value and its [`END`], all of them a byte at a time, so a state is filled only
    /// after every state of a shorter label: the state `v[..d]` and, read without anchor from
    /// `v[1..d]`, its fallback (the longest proper suffix that is also a state, filled already).
    /// A state takes its own length where a value ends there (or continues past it), else its
    /// fallback's entry.
    fn fill_tables(&mut self, values: &[Vec<u8>]) {
        let nfa = &self.nfa;
        let anchored = nfa
            .start_state(Anchored::Yes)
            .expect("a contiguous NFA starts anchored");
        let unanchored = nfa
            .start_state(Anchored::No)
            .expect("a contiguous NFA starts unanchored");
        let mut by_len: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
        by_len.sort_by_key(|v| std::cmp::Reverse(v.len()));
        // (value, its state, its fallback's state), the shortest last.
        let mut walks: Vec<(&[u8], StateID, StateID)> = by_len.iter().map(|v| (*v, anchored, unanchored)).collect();
        // Bit 0: a value ends in the state; bit 1: a value continues past it; bit 2: reached at
        // this depth, not yet filled.
        let mut marks: Vec<u32> = vec![];
        let mut depth = 0;
        while !walks.is_empty() {
            depth += 1;
            while walks.last().is_some_and(|w| w.0.len() + 1 < depth) {
                walks.pop();
            }
            for (v, state, fallback) in walks.iter_mut() {
                let byte = v.get(depth - 1).copied().unwrap_or(END);
                *state = nfa.next_state(Anchored::Yes, *state, byte);
                if depth > 1 {
                    *fallback = nfa.next_state(Anchored::No, *fallback, byte);
                }
                *entry(&mut marks, *state) |= 4 | match depth.cmp(&v.len()) {
                    std::cmp::Ordering::Less => 2,
                    std::cmp::Ordering::Equal => 1,
                    std::cmp::Ordering::Greater => 0,
                };
            }
            for &(_, state, fallback) in &walks {
                let mark = std::mem::take(entry(&mut marks, state));
                if mark == 0 {
                    continue; // filled by another value with this start
                }
                let fallback_entry = |table: &Vec<u32>| table.get(fallback.as_usize()).copied().unwrap_or(0);
                let (ends, continues) = (mark & 1 != 0, mark & 2 != 0);
                *entry(&mut self.longest_value, state) = if ends {
                    depth as u32
                } else {
                    fallback_entry(&self.longest_value)
                };
                *entry(&mut self.open_start, state) = if continues {
                    depth as u32
                } else {
                    fallback_entry(&self.open_start)
                };
            }
        }
    }

    /// The state after reading `bytes` from the start.
    fn run(&self, bytes: &[u8]) -> StateID {
        let start = self
            .nfa
            .start_state(Anchored::No)
            .expect("a contiguous NFA starts unanchored");
        bytes
            .iter()
            .fold(start, |state, &byte| self.nfa.next_state(Anchored::No, state, byte))
    }

    /// The length of the longest suffix of `bytes` that a longer value starts with (0: none).
    pub(super) fn open_start_len(&self, bytes: &[u8]) -> usize {
        let state = self.run(bytes);
        self.open_start.get(state.as_usize()).copied().unwrap_or(0) as usize
    }

    /// For each place in `bytes` where a value ends, in order, the start and end of the longest
    /// value ending there (the shorter ones ending there lie inside it).
    pub(super) fn longest_occurrences<'a>(&'a self, bytes: &'a [u8]) -> impl Iterator<Item = (usize, usize)> + 'a {
        let mut state = self
            .nfa
            .start_state(Anchored::No)
            .expect("a contiguous NFA starts unanchored");
        bytes.iter().enumerate().filter_map(move |(i, &byte)| {
            state = self.nfa.next_state(Anchored::No, state, byte);
            let len = self.longest_value.get(state.as_usize()).copied().unwrap_or(0) as usize;
            (len > 0).then_some((i + 1 - len, i + 1))
        })
    }
}

/// A stream read once, as it comes, for whole values (see [`Masker::screen`](super::Masker::screen)).
pub struct ValueScreen {
    automaton: std::sync::Arc<ValueAutomaton>,
    state: StateID,
    /// The end of what was fed that a value may be starting with: not yet passed on.
    held: Vec<u8>,
    /// Bytes fed so far.
    fed: u64,
}

impl ValueScreen {
    pub(super) fn new(automaton: std::sync::Arc<ValueAutomaton>) -> ValueScreen {
        let state = automaton
            .nfa
            .start_state(Anchored::No)
            .expect("a contiguous NFA starts unanchored");
        ValueScreen {
            automaton,
            state,
            held: Vec::new(),
            fed: 0,
        }
    }

    /// Takes the next piece of the stream: returns the bytes (of this piece and held from before)
    /// that no value can be part of, or the offset in the stream where a value occurs. The end
    /// that may be the start of a value is held back, at most as many bytes as the longest value
    /// less one.
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<u8>, u64> {
        let automaton = &self.automaton;
        for (i, &byte) in data.iter().enumerate() {
            self.state = automaton.nfa.next_state(Anchored::No, self.state, byte);
            let len = automaton.longest_value.get(self.state.as_usize()).copied().unwrap_or(0);
            if len > 0 {
                return Err(self.fed + i as u64 + 1 - u64::from(len));
            }
        }
        self.fed += data.len() as u64;
        self.held.extend_from_slice(data);
        let open = automaton.open_start.get(self.state.as_usize()).copied().unwrap_or(0) as usize;
        let clean = self.held.len() - open.min(self.held.len());
        Ok(self.held.drain(..clean).collect())
    }

    /// At the stream's end (no value found): the bytes held back.
    pub fn finish(self) -> Vec<u8> {
        self.held
    }
}
