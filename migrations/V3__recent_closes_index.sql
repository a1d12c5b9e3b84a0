-- Serves `lapse status`: lateness of recent closes without scanning every order.
CREATE INDEX orders_by_closed_at ON orders (closed_at) WHERE closed_at IS NOT NULL;
