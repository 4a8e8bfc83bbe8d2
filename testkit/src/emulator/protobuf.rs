//! Protobuf encoding of a Swagger 2.0 document in gnostic's `openapi.v2.Document` message, which
//! is what client-go asks `/openapi/v2` for (`application/com.github.proto-openapi.spec.v2@v1.0+protobuf`).
//! Only the parts kubectl reads are encoded: paths with operations, parameters, responses and
//! vendor extensions, and definitions with their schemas.

use serde_json::Value;

#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn varint(&mut self, mut v: u64) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                self.0.push(b);
                return;
            }
            self.0.push(b | 0x80);
        }
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint((u64::from(field) << 3) | u64::from(wire));
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn string(&mut self, field: u32, s: &str) {
        if !s.is_empty() {
            self.bytes(field, s.as_bytes());
        }
    }

    fn msg(&mut self, field: u32, m: Msg) {
        self.bytes(field, &m.0);
    }

    fn boolean(&mut self, field: u32, b: bool) {
        if b {
            self.key(field, 0);
            self.varint(1);
        }
    }

    fn int(&mut self, field: u32, v: i64) {
        self.key(field, 0);
        self.varint(v as u64);
    }

    fn double(&mut self, field: u32, v: f64) {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

/// `Any { yaml = 2 }`: JSON is YAML.
fn any(v: &Value) -> Msg {
    let mut m = Msg::default();
    m.string(2, &v.to_string());
    m
}

fn named_any(name: &str, v: &Value) -> Msg {
    let mut m = Msg::default();
    m.string(1, name);
    m.msg(2, any(v));
    m
}

fn vendor_extensions(obj: &serde_json::Map<String, Value>, field: u32, m: &mut Msg) {
    for (k, v) in obj.iter().filter(|(k, _)| k.starts_with("x-")) {
        m.msg(field, named_any(k, v));
    }
}

fn schema(s: &Value) -> Msg {
    let mut m = Msg::default();
    let Some(o) = s.as_object() else {
        return m;
    };
    let st = |k: &str| o.get(k).and_then(Value::as_str).unwrap_or_default();
    m.string(1, st("$ref"));
    m.string(2, st("format"));
    m.string(3, st("title"));
    m.string(4, st("description"));
    if let Some(d) = o.get("default") {
        m.msg(5, any(d));
    }
    if let Some(x) = o.get("maximum").and_then(Value::as_f64) {
        m.double(7, x);
    }
    m.boolean(8, o.get("exclusiveMaximum").and_then(Value::as_bool).unwrap_or(false));
    if let Some(x) = o.get("minimum").and_then(Value::as_f64) {
        m.double(9, x);
    }
    m.boolean(10, o.get("exclusiveMinimum").and_then(Value::as_bool).unwrap_or(false));
    for (key, field) in [
        ("maxLength", 11),
        ("minLength", 12),
        ("maxItems", 14),
        ("minItems", 15),
        ("maxProperties", 17),
        ("minProperties", 18),
    ] {
        if let Some(x) = o.get(key).and_then(Value::as_i64) {
            m.int(field, x);
        }
    }
    m.string(13, st("pattern"));
    if let Some(req) = o.get("required").and_then(Value::as_array) {
        for r in req.iter().filter_map(Value::as_str) {
            m.string(19, r);
        }
    }
    if let Some(e) = o.get("enum").and_then(Value::as_array) {
        for v in e {
            m.msg(20, any(v));
        }
    }
    match o.get("additionalProperties") {
        Some(Value::Bool(b)) => {
            let mut a = Msg::default();
            a.key(2, 0);
            a.varint(u64::from(*b));
            m.msg(21, a);
        }
        Some(s @ Value::Object(_)) => {
            let mut a = Msg::default();
            a.msg(1, schema(s));
            m.msg(21, a);
        }
        _ => {}
    }
    if let Some(t) = o.get("type").and_then(Value::as_str) {
        let mut ti = Msg::default();
        ti.string(1, t);
        m.msg(22, ti);
    }
    if let Some(items) = o.get("items") {
        let mut ii = Msg::default();
        ii.msg(1, schema(items));
        m.msg(23, ii);
    }
    if let Some(all) = o.get("allOf").and_then(Value::as_array) {
        for s in all {
            m.msg(24, schema(s));
        }
    }
    if let Some(props) = o.get("properties").and_then(Value::as_object) {
        let mut p = Msg::default();
        for (k, v) in props {
            let mut ns = Msg::default();
            ns.string(1, k);
            ns.msg(2, schema(v));
            p.msg(1, ns);
        }
        m.msg(25, p);
    }
    vendor_extensions(o, 31, &mut m);
    m
}

fn operation(op: &Value) -> Msg {
    let mut m = Msg::default();
    let Some(o) = op.as_object() else {
        return m;
    };
    m.string(3, o.get("description").and_then(Value::as_str).unwrap_or_default());
    m.string(5, o.get("operationId").and_then(Value::as_str).unwrap_or_default());
    for (key, field) in [("produces", 6), ("consumes", 7)] {
        for s in o
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            m.string(field, s);
        }
    }
    for p in o.get("parameters").and_then(Value::as_array).into_iter().flatten() {
        let s = |k: &str| p.get(k).and_then(Value::as_str).unwrap_or_default();
        let mut q = Msg::default();
        q.boolean(1, p.get("required").and_then(Value::as_bool).unwrap_or(false));
        q.string(2, s("in"));
        q.string(3, s("description"));
        q.string(4, s("name"));
        q.string(6, s("type"));
        let mut nb = Msg::default();
        nb.msg(if s("in") == "path" { 4 } else { 3 }, q);
        let mut param = Msg::default();
        param.msg(2, nb);
        let mut item = Msg::default();
        item.msg(1, param);
        m.msg(8, item);
    }
    if let Some(resps) = o.get("responses").and_then(Value::as_object) {
        let mut rs = Msg::default();
        for (code, r) in resps {
            let mut resp = Msg::default();
            resp.string(1, r.get("description").and_then(Value::as_str).unwrap_or_default());
            if let Some(s) = r.get("schema") {
                let mut si = Msg::default();
                si.msg(1, schema(s));
                resp.msg(2, si);
            }
            let mut rv = Msg::default();
            rv.msg(1, resp);
            let mut named = Msg::default();
            named.string(1, code);
            named.msg(2, rv);
            rs.msg(1, named);
        }
        m.msg(9, rs);
    }
    vendor_extensions(o, 13, &mut m);
    m
}

/// Encodes a Swagger 2.0 JSON document as `openapi.v2.Document`.
pub fn encode_document(doc: &Value) -> Vec<u8> {
    let mut d = Msg::default();
    d.string(1, doc.get("swagger").and_then(Value::as_str).unwrap_or("2.0"));
    let mut info = Msg::default();
    info.string(
        1,
        doc.pointer("/info/title").and_then(Value::as_str).unwrap_or_default(),
    );
    info.string(
        2,
        doc.pointer("/info/version").and_then(Value::as_str).unwrap_or_default(),
    );
    d.msg(2, info);
    let mut paths = Msg::default();
    for (path, item) in doc.get("paths").and_then(Value::as_object).into_iter().flatten() {
        let mut pi = Msg::default();
        for (method, field) in [("get", 2), ("put", 3), ("post", 4), ("delete", 5), ("patch", 8)] {
            if let Some(op) = item.get(method) {
                pi.msg(field, operation(op));
            }
        }
        let mut named = Msg::default();
        named.string(1, path);
        named.msg(2, pi);
        paths.msg(2, named);
    }
    d.msg(8, paths);
    let mut defs = Msg::default();
    for (name, s) in doc.get("definitions").and_then(Value::as_object).into_iter().flatten() {
        let mut named = Msg::default();
        named.string(1, name);
        named.msg(2, schema(s));
        defs.msg(1, named);
    }
    d.msg(9, defs);
    d.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_strings() {
        let mut m = Msg::default();
        m.varint(300);
        assert_eq!(m.0, vec![0xac, 0x02]);
        let mut m = Msg::default();
        m.string(1, "2.0");
        assert_eq!(m.0, vec![0x0a, 3, b'2', b'.', b'0']);
        let doc = serde_json::json!({"swagger": "2.0", "info": {"title": "K", "version": "v"}});
        assert_eq!(&encode_document(&doc)[..5], &[0x0a, 3, b'2', b'.', b'0']);
    }
}
