//! Compiling constraints into llguidance parsers, with a small cache keyed
//! by the request's `extra_args` text: the worker's instance is asked
//! `check-request` and then announced the same request, and should
//! compile its grammar once.

use std::collections::VecDeque;

use llguidance::toktrie::TokEnv;
use llguidance::{ParserFactory, TokenParser};

use crate::constraint;

/// How many compiled grammars the cache keeps (least recently used goes
/// first). A grammar's compiled form is shared by its requests' parsers, so
/// this bounds memory, not concurrency.
pub const CACHE_ENTRIES: usize = 32;

/// What compiling a request's `extra_args` gave: a fresh parser to clone
/// per request, `None` when the request has no constraint, or the error.
pub type Compiled = Result<Option<TokenParser>, String>;

/// Compiles constraints against one vocabulary.
pub struct Compiler {
    factory: ParserFactory,
    /// Most recently used last.
    cache: VecDeque<(String, Compiled)>,
    /// Constraints compiled so far (cache misses), for diagnostics.
    compiles: u64,
}

impl Compiler {
    /// A compiler for the vocabulary `env`.
    pub fn new(env: &TokEnv) -> Result<Self, String> {
        let mut factory = ParserFactory::new_simple(env)
            .map_err(|e| format!("llguidance refused the vocabulary: {e}"))?;
        // Nothing reads the plugin's stderr; errors come back as values.
        factory.quiet();
        // Error messages go to API clients: keep them to the cause, without
        // a dump of the parser state and grammar.
        factory.limits_mut().verbose_errors = false;
        Ok(Compiler {
            factory,
            cache: VecDeque::with_capacity(CACHE_ENTRIES),
            compiles: 0,
        })
    }

    /// The vocabulary this compiler targets.
    pub fn tok_env(&self) -> &TokEnv {
        self.factory.tok_env()
    }

    /// Compiles the constraint in `extra_args` (see [`constraint::parse`]):
    /// `Ok(Some(parser))` a fresh parser for one request, `Ok(None)` when
    /// the request has no constraint, or an error naming the problem.
    pub fn compile(&mut self, extra_args: &str) -> Compiled {
        let hit = self.cache.iter().position(|(k, _)| k == extra_args);
        if let Some(entry) = hit.and_then(|pos| self.cache.remove(pos)) {
            let result = entry.1.clone();
            self.cache.push_back(entry);
            return result;
        }
        self.compiles += 1;
        let result = self.compile_uncached(extra_args);
        if self.cache.len() == CACHE_ENTRIES {
            self.cache.pop_front();
        }
        self.cache
            .push_back((extra_args.to_owned(), result.clone()));
        result
    }

    /// How many times `extra_args` were compiled rather than found in the
    /// cache.
    pub fn compiles(&self) -> u64 {
        self.compiles
    }

    fn compile_uncached(&self, extra_args: &str) -> Compiled {
        let Some(c) = constraint::parse(extra_args)? else {
            return Ok(None);
        };
        match self.factory.create_parser(c.to_grammar()) {
            Ok(parser) => Ok(Some(parser)),
            Err(e) => {
                let key = constraint::KEY;
                let kind = c.kind();
                let mut msg = format!("{key}.{kind} does not compile: {}", llg_error(&e));
                if let constraint::Constraint::Grammar(g) = &c {
                    if g.contains("::=") {
                        msg.push_str(
                            " (this looks like GBNF; only Lark syntax as llguidance reads it is \
                             accepted: write `rule: a | b` instead of `rule ::= a | b`)",
                        );
                    }
                }
                Err(msg)
            }
        }
    }
}

/// llguidance's error text, without the marker it appends when verbose
/// errors are off (which says nothing to an API client).
pub fn llg_error(e: &impl std::fmt::Display) -> String {
    let text = e.to_string();
    text.trim_end()
        .trim_end_matches("<non-verbose/>")
        .trim_end()
        .to_owned()
}
